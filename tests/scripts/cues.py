"""A test's cue to a job's script: a file the test creates when the script may go on."""
import os
import time


def wait_for_file(path, timeout):
    """True once ``path`` exists; False if it did not within ``timeout`` seconds (the
    caller ends its process naming the cue that never came)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
