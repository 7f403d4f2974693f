#!/usr/bin/env python3
# The cost of a confined local block's own PID namespace, as the fork server pays it (run as
# root, or in a user namespace): `python3 tests/benches/pid_namespace.py`.
# Time from a request to the status pipe's EOF (what Tandem waits on), for a waiter that forks
# a block (today's shape) against one that first makes a PID and mount namespace, forks an init
# that mounts /proc and opens it, and forks the block from there.
import ctypes, os, time, statistics
libc = ctypes.CDLL(None, use_errno=True)
def run(ns):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        if ns:
            if libc.unshare(0x20000000 | 0x20000) or libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None):
                os._exit(3)
            init = os.fork()
            if init:
                os.close(w); os.waitpid(init, 0); os._exit(0)
            if libc.mount(b"proc", b"/proc", b"proc", 0xe, None):
                os._exit(3)
            fd = os.open("/proc", os.O_PATH | os.O_DIRECTORY); os.close(fd)
        b = os.fork()
        if b == 0: os._exit(0)
        _, st = os.waitpid(b, 0)
        os.write(w, b"%d\n" % st)
        os._exit(0)
    os.close(w)
    while os.read(r, 64): pass
    os.close(r)
    if os.waitpid(pid, 0)[1] != 0:
        raise SystemExit("the kernel refused the namespace: run as root")
a, b = [], []
for i in range(300):
    for ns, out in ((False, a), (True, b)):
        t = time.perf_counter(); run(ns); out.append(time.perf_counter() - t)
ma, mb = statistics.median(a)*1e3, statistics.median(b)*1e3
print(f"| waiter forks the block | {ma:.2f} ms |\n| waiter makes a PID and mount namespace, its init mounts /proc and forks the block | {mb:.2f} ms |\n| ratio | {mb/ma:.2f} |")
