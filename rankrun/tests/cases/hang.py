"""Every rank sleeps for an hour: only the runner's timeout can end this run."""
import time

print("going to sleep", flush=True)
time.sleep(3600)
