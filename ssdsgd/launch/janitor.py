"""A directory that outlives no launcher: the job's key directory is removed when the
launcher ends, even by SIGKILL (issue 30, item 6: a killed launcher left its 0600 key file
in /tmp).

Nothing runs in a process killed by SIGKILL, so the removal is a tiny child's job: it
holds the read end of a pipe whose only write end is the launcher's, and when that end
closes (the launcher exited, however) it removes the directory. It runs in a session of
its own, so the launcher's Ctrl-C and the job's signals do not reach it, and it imports
only the standard library (a few ms). It gets an empty environment: it needs none, and
a tool that stops a job's processes by a variable of their environment (the tests'
harness does, by its tag) would kill it before it removed the keys.
"""
import os
import subprocess
import sys

_CHILD = ("import shutil, sys\n"
          "sys.stdin.buffer.read()\n"          # EOF: the launcher is gone
          "shutil.rmtree(sys.argv[1], ignore_errors=True)\n")


class Janitor:
    """Removes ``path`` when this process ends (``close()`` removes it at once)."""

    def __init__(self, path):
        self.path = path
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _CHILD, path],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     close_fds=True, env={})

    def close(self):
        """The launcher's normal end: the child removes the directory and exits."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if os.path.exists(self.path):      # the child could not: do it here
            import shutil
            shutil.rmtree(self.path, ignore_errors=True)
