"""Every rank starts a child, writes both pids to $PIDS_FILE, then hangs until someone ends the run."""
import os
import subprocess
import sys
import time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
with open(os.environ["PIDS_FILE"], "a") as pids:
    pids.write(f"{os.getpid()}\n{child.pid}\n")
time.sleep(3600)
