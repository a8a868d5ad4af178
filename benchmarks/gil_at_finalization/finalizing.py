"""Python shuts down while a native thread, like a gloo worker, waits to take the GIL."""
import sys
import time

import late_gil


class SlowToFree:  # keeps finalization busy while the native thread wakes up
    def __del__(self, sleep=time.sleep):
        sleep(1.0)


keep = SlowToFree()
late_gil.start(0.3)  # the thread takes the GIL in a noexcept destructor 0.3 s from now
print(sys.version.split()[0], "main done", flush=True)
