"""Forks a child that returns from the script instead of calling os._exit; the parent waits for it."""
import os
import time

pid = os.fork()
if pid == 0:
    print(f"child of rank {os.environ['RANK']} returns without os._exit", flush=True)
else:
    os.waitpid(pid, 0)
    time.sleep(0.2)
    print(f"rank {os.environ['RANK']} parent done", flush=True)
