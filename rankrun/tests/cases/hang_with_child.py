"""Every rank starts a child process, prints its pid, then hangs: the child must die with the run."""
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print(f"child {child.pid}", flush=True)
time.sleep(3600)
