# Tandem's in-container runner: the container's main process (under docker-init), fed one
# request per line on stdin and answering in frames on stdout, so a block costs a fork, not
# a `docker exec` round trip. Frame: kind (1 byte), length (4 bytes, big-endian), payload.
#   R ready            o/e stdout/stderr bytes       O/E bytes dropped (8 bytes), tail follows
#   x block ended (JSON: code, signal, oom)          d request done    ! runner error (text)
#   t bytes the block wrote on its tools channel
#   c what a block changed in the workspace (JSON: changed [[path, kind]], removed, all,
#     inline), before its x, when the workspace is the container's own (argv[2] == "volume")
#   a a piece of a tar of the changed files, before their c (inline: small changes come
#     this way; the rest Tandem copies through the engine's archive calls)
# Requests: {"op": "run", ...}, {"op": "kill"} and {"op": "tool", "data": ...} (the answer
# to a call, while a block runs), {"op": "wipe"}, {"op": "release"}, {"op": "rescan"} (take
# the workspace as it is now as seen, after Tandem put files in it). The whole container is
# the session, so after a block ends every process but init and this runner is killed, but
# for servers: a process that holds a listening TCP socket when its block has ended keeps
# running (Tandem publishes its port) until the sandbox closes, and so do the relays Tandem
# execs into the sandbox (to reach such a port, or to carry connections to its egress proxy).
#
# The runner runs as root with only CAP_SETUID, CAP_SETGID and CAP_KILL; every block, and
# everything that touches the workspace on a block's behalf, runs as the unprivileged user
# named by argv[1]. Being another user is what keeps a block away from the runner: it cannot
# open /proc/<runner>/fd/1 to forge frames, read the requests on fd 0, or signal the runner.
# Where the sandbox forbids root (a Kubernetes pod with runAsNonRoot), the runner starts as
# the blocks' user and makes itself undumpable instead, which keeps its /proc entries and
# descriptors out of a block's reach; a block can still kill it, and the session then ends as
# when a block kills the container, with a new runner in its place.
#
# It is not the local executor's fork server because its boundary is another: the uid and
# the container's pid namespace (kill(-1) ends a block's every process), where the fork
# server's is Landlock, seccomp and a subreaper per block. What a block sees is the same in
# both, and the shared conformance suite holds both to it.
import json, os, resource, select, shutil, signal, stat, struct, sys, threading, time

ME = os.getpid()
WORKSPACE = "/workspace"


def parse_user(spec):
    user, _, group = spec.partition(":")
    if user.isdigit():
        uid = int(user)
        gid = int(group) if group.isdigit() else uid
    else:
        import pwd

        entry = pwd.getpwnam(user)
        uid, gid = entry.pw_uid, entry.pw_gid
    if group and not group.isdigit():
        import grp

        gid = grp.getgrnam(group).gr_gid
    return uid, gid


UID, GID = parse_user(sys.argv[1] if len(sys.argv) > 1 else "65534:65534")
# A workspace that is a volume of the container's own, which Tandem copies out through the
# engine's archive calls after each block: the runner tells it what changed.
SYNC = len(sys.argv) > 2 and sys.argv[2] == "volume"
if SYNC:
    # Loaded once here, not in each block's scan (a fork of this process has them).
    import io, tarfile


def drop_privileges():
    """Becomes the blocks' user for good (no-op when the container already runs as one)."""
    if os.getuid() == 0 and UID != 0:
        os.setgroups([])
        os.setgid(GID)
        os.setuid(UID)


def send(kind, payload=b""):
    data = kind + struct.pack(">I", len(payload)) + payload
    while data:
        data = data[os.write(1, data):]


def others():
    """Pids of live processes other than init and this runner."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) not in (1, ME):
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        found.append(int(name))
            except (OSError, IndexError):
                pass
    return found


# Servers that outlived their blocks: pid -> its start time, which tells a reused pid apart.
KEPT = {}


def start_time(pid):
    """The start time of a live (not zombie) process, else None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] == b"Z" else fields[19]
    except (OSError, IndexError):
        return None


def entered(pid):
    """Whether the process came in from outside the sandbox (an exec: Tandem's relays), which
    its parent of 0 in this pid namespace says. A block's process cannot have one: its
    parent is its parent, or the reaper of its orphans (init, or this runner)."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[1] == b"0"
    except (OSError, IndexError):
        return False


def spared():
    """The processes a block's end or kill leaves alive: the kept servers that still run,
    and Tandem's relays."""
    for pid, when in list(KEPT.items()):
        if start_time(pid) != when:
            del KEPT[pid]
    keep = set(KEPT)
    keep.update(p for p in others() if entered(p))
    return keep


def as_user(work):
    """The bytes `work()` returns, run by a child that is the blocks' user: what the blocks
    made private, or their /proc/<pid>/fd, the runner (another user) may not read."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        # No process to be had (a fork bomb holds the sandbox's pids): nothing is read.
        os.close(r)
        os.close(w)
        return b""
    if pid == 0:
        try:
            os.close(r)
            drop_privileges()
            data = work()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    wait_block(pid, 0)
    return b"".join(chunks)


def listening(pids):
    """Those of `pids` that hold a listening TCP socket."""
    if not pids:
        return set()

    def find():
        sockets = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as f:
                    for line in f:
                        cols = line.split()
                        if len(cols) > 9 and cols[3] == "0A":
                            sockets.add("socket:[%s]" % cols[9])
            except OSError:
                pass
        found = []
        for pid in pids:
            base = "/proc/%d/fd" % pid
            try:
                names = os.listdir(base)
            except OSError:
                continue
            for name in names:
                try:
                    if os.readlink(base + "/" + name) in sockets:
                        found.append(pid)
                        break
                except OSError:
                    pass
        return json.dumps(found).encode()

    try:
        return set(json.loads(as_user(find) or b"[]"))
    except ValueError:
        return set()


def kill_block():
    """Kills every process but init, this runner and the spared ones. Each pass stops what
    it finds before killing it, so that a fork bomb cannot outrun the scan; one that still
    does after 100 passes takes the spared processes with it (kill(-1))."""
    keep = spared()
    if not keep:
        kill_all()
        return
    for _ in range(100):
        left = [p for p in others() if p not in keep]
        if not left:
            wait_reaped()
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for p in left:
                try:
                    os.kill(p, sig)
                except OSError:
                    pass
        reap()
    kill_all()


def settle(ended):
    """After a block's end: keeps the servers it left listening, then kills the rest. A
    process that is still starting is given until half a second after `ended` to listen."""
    spare = spared()
    if not [p for p in others() if p not in spare]:
        return
    while True:
        fresh = [p for p in others() if p not in spare]
        found = listening(fresh)
        if found or monotonic() >= ended + 0.5:
            break
        time.sleep(0.05)
    for pid in found:
        when = start_time(pid)
        if when is not None:
            KEPT[pid] = when
    kill_block()


# Pipes of ended blocks that kept servers may still write to, read and dropped by the one
# drainer thread. That thread is started with the runner: a block that holds every pid the
# sandbox allows (a fork bomb) must not be able to make the runner fail to start one later.
DRAINING = []
DRAIN_LOCK = threading.Lock()
DRAIN_R, DRAIN_W = os.pipe()
os.set_blocking(DRAIN_W, False)


def drainer():
    while True:
        with DRAIN_LOCK:
            live = list(DRAINING)
        # poll, not select: a pipe's number may be past select's 1024.
        poller = select.poll()
        for fd in live + [DRAIN_R]:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll():
            if fd == DRAIN_R:
                os.read(DRAIN_R, 512)
                continue
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with DRAIN_LOCK:
                    DRAINING.remove(fd)
                os.close(fd)


def drain(fds):
    """Hands the ended block's pipes to the drainer, so that the kept servers' logging does
    not fail; each pipe is closed when the last server holding it dies."""
    if not fds:
        return
    with DRAIN_LOCK:
        DRAINING.extend(fds)
    try:
        os.write(DRAIN_W, b"+")
    except BlockingIOError:
        pass  # the drainer has wake-ups pending already


def kill_all():
    # kill(-1) reaches every process in the container's pid namespace but init and this
    # runner, in one pass the kernel does not let new forks race (a /proc scan loses to a
    # fork bomb).
    KEPT.clear()
    for _ in range(100):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        if not others():
            break
    wait_reaped()


def wait_reaped():
    """Waits, at most 10 s, until the killed processes are reaped as well: a zombie still
    holds its pid, and after a fork bomb the next block must find pids to fork. Waited for
    are the zombies this runner (their subreaper) will reap: its own, and those whose
    parent is dying too. Init's and a kept server's are theirs to reap."""
    deadline = monotonic() + 10.0
    while True:
        reap()
        table = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                table[int(name)] = (fields[0], int(fields[1]))
            except (OSError, IndexError, ValueError):
                continue
        waiting = any(
            state == b"Z" and (ppid == ME or table.get(ppid, (b"Z",))[0] == b"Z")
            for state, ppid in table.values()
        )
        if not waiting or monotonic() >= deadline:
            return
        time.sleep(0.01)


REAPED = {}  # wait statuses that reap() collected, so the block's own is not lost


def reap():
    try:
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            REAPED[pid] = status
    except ChildProcessError:
        pass


def wait_block(pid, flags):
    """(done, status) of the block, whether reap() or this call collected it."""
    if pid in REAPED:
        return True, REAPED.pop(pid)
    try:
        done, status = os.waitpid(pid, flags)
    except ChildProcessError:
        return True, REAPED.pop(pid, signal.SIGKILL)
    return done != 0, status


# What a block uses: the sandbox's cgroup where it can be read (CPU and the peak of memory),
# and this runner's own I/O counts, into which the kernel adds each child's it reaps. A
# figure that cannot be read is left out, never reported as zero, and the reason is said.
def read_first(paths):
    for path in paths:
        try:
            with open(path) as f:
                return path, f.read()
        except OSError:
            pass
    return None, None


def cgroup_cpu_ns():
    path, text = read_first(["/sys/fs/cgroup/cpu.stat"])
    if text is not None:
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "usage_usec":
                return "cgroup v2", int(v) * 1000
    path, text = read_first(["/sys/fs/cgroup/cpuacct/cpuacct.usage",
                             "/sys/fs/cgroup/cpu,cpuacct/cpuacct.usage"])
    if text is not None and text.strip().isdigit():
        return "cgroup v1", int(text)
    return None, None


def cgroup_peak():
    for path, source in (("/sys/fs/cgroup/memory.peak", "cgroup v2"),
                         ("/sys/fs/cgroup/memory/memory.max_usage_in_bytes", "cgroup v1")):
        _, text = read_first([path])
        if text is not None and text.strip().isdigit():
            return source, int(text)
    return None, None


def written_bytes():
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k == "write_bytes":
                    return int(v)
    except (OSError, ValueError):
        pass
    return None


def children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Usage:
    """Counts taken at a block's start, turned into its `resources` at its end."""

    def __init__(self):
        self.source, self.cpu = cgroup_cpu_ns()
        self.rusage = children_cpu()
        self.written = written_bytes()

    def report(self):
        out, why = {}, []
        source, cpu = cgroup_cpu_ns()
        if cpu is not None and self.cpu is not None:
            out["cpu_secs"] = round(max(0, cpu - self.cpu) / 1e9, 6)
        else:
            source = "getrusage"
            out["cpu_secs"] = round(max(0.0, children_cpu() - self.rusage), 6)
            why.append("the sandbox's cgroup gives no CPU time: the block's reaped processes only")
        peak_source, peak = cgroup_peak()
        if peak is not None:
            out["peak_memory_bytes"] = peak
            # The runner cannot reset the peak (the cgroup is mounted read-only): Tandem
            # outside the sandbox does so where it can, and then says it is the block's.
            out["peak_memory_scope"] = "session"
            source = source or peak_source
        else:
            why.append("the sandbox's cgroup gives no memory peak")
        written = written_bytes()
        if written is not None and self.written is not None:
            out["disk_written_bytes"] = max(0, written - self.written)
        else:
            why.append("the kernel keeps no I/O counts here (/proc/self/io)")
        out["source"] = source
        if why:
            out["unavailable"] = "; ".join(why)
        return out


def oom_kills():
    for path, key in (("/sys/fs/cgroup/memory.events", "oom_kill"),
                      ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill")):
        try:
            with open(path) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == key:
                        return int(v)
        except (OSError, ValueError):
            pass
    return 0


class Capture:
    """Forwards the head (the first half of `cap`, rounded up) live and keeps the last half
    after it: the split Tandem's own capture buffer makes, so nothing is sent only to be cut."""

    def __init__(self, kind, cap):
        self.kind, self.head_left, self.tail_cap = kind, cap - cap // 2, cap // 2
        self.tail, self.dropped = bytearray(), 0

    def push(self, data):
        live = data[: self.head_left]
        if live:
            self.head_left -= len(live)
            send(self.kind, live)
        rest = data[len(live):]
        if rest:
            self.tail += rest
            excess = len(self.tail) - self.tail_cap
            if excess > 0:
                self.dropped += excess
                del self.tail[:excess]

    def finish(self):
        if self.dropped:
            send(self.kind.upper(), struct.pack(">Q", self.dropped))
        for i in range(0, len(self.tail), 1 << 16):
            send(self.kind, bytes(self.tail[i:i + (1 << 16)]))


# A Python block runs as `python3 -c BOOT script`: BOOT runs the script as `python3 script`
# would, and then saves the figures it showed (`plt.show()` draws nothing without a screen)
# as figure-N.png, as the local executor's fork server does.
# PRELUDE (executors/core/src/prelude.py) is set above this file by the runner's crate.
BOOT = PRELUDE + "\nrun_as_main(sys.argv[1])\n"


# Where the tools module and command are put: a tmpfs of the runner's own that blocks can
# read and run but not change.
TOOLS_DIR = "/run/tandem/tools"
TOOLS_READY = []


def install_tools(files):
    if TOOLS_READY:
        return
    os.makedirs(TOOLS_DIR, mode=0o755, exist_ok=True)
    for name, text in files.items():
        path = os.path.join(TOOLS_DIR, os.path.basename(name))
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o755)
    TOOLS_READY.append(True)


def start(req, out_w, err_w, tools=None):
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        # The dispositions of a fresh process: Python ignores SIGPIPE and SIGXFSZ, and an
        # ignored signal stays ignored across exec.
        for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if tools is not None:
            # The block's end of its tools channel, at a number it is told.
            os.dup2(tools, 3)
            os.set_inheritable(3, True)
            os.closerange(4, 65536)
        else:
            os.closerange(3, 65536)
        drop_privileges()
        # Written as the block's user: a link an earlier block planted can lead only where
        # that user could write anyway. Before the limits, which are the code's, not its
        # script's (a tiny file size limit would stop the write).
        path = req["path"]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if req.get("transient"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        with open(path, "x" if req.get("transient") else "w", encoding="utf-8") as f:
            f.write(req["code"])
        for name, limit in req.get("rlimits", []):
            resource.setrlimit(getattr(resource, name), (limit, limit))
        os.chdir(WORKSPACE)
        argv = req["argv"]
        if os.path.basename(argv[0]).startswith("python") and len(argv) == 2:
            argv = [argv[0], "-c", BOOT, argv[1]]
        os.execvpe(argv[0], argv, req["env"])
    except BaseException as e:
        os.write(2, ("tandem: cannot start %s: %s\n" % (req["argv"][0], e)).encode())
    os._exit(127)


def run(req, stdin_buf):
    path = req["path"]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    ooms = oom_kills()
    usage = Usage()
    ours = theirs = None
    if req.get("tools"):
        import socket

        install_tools(req["tools"])
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        env = req["env"]
        env["TANDEM_TOOLS_FD"] = "3"
        env["PYTHONPATH"] = TOOLS_DIR
        env["PATH"] = TOOLS_DIR + ":" + env.get("PATH", "/usr/bin:/bin")
    try:
        pid = start(req, out_w, err_w, theirs.fileno() if theirs else None)
    except OSError as e:  # fork failed: a process limit reached, or out of memory
        for fd in (out_r, out_w, err_r, err_w):
            os.close(fd)
        if ours is not None:
            ours.close()
            theirs.close()
        send(b"e", ("tandem: cannot start the block: %s\n" % e).encode())
        send(b"x", json.dumps({"code": 1, "signal": None, "oom": False}).encode())
        return stdin_buf
    os.close(out_w)
    os.close(err_w)
    if theirs is not None:
        theirs.close()
    caps = {out_r: Capture(b"o", req["cap"]), err_r: Capture(b"e", req["cap"])}
    status, deadline = None, None
    calls = ours.fileno() if ours is not None else None
    answers = bytearray()  # answers the block has not read yet
    while caps:
        wait = 0.05 if status is None else max(0.0, deadline - monotonic())
        watch = list(caps) + [0, WAKE_R] + ([calls] if calls is not None else [])
        ready, writable, _ = select.select(watch, [calls] if answers else [], [], wait)
        if writable and answers:
            try:
                del answers[: os.write(calls, answers)]
            except BlockingIOError:
                pass
            except OSError:
                answers.clear()
        for fd in ready:
            if fd == calls:
                try:
                    chunk = os.read(calls, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    send(b"t", chunk)
                else:
                    calls = None
            elif fd == 0:
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    kill_all()
                    os._exit(0)
                stdin_buf += chunk
                while b"\n" in stdin_buf:
                    line, stdin_buf = stdin_buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    op = json.loads(line)
                    if op.get("op") == "kill":
                        kill_block()
                    elif op.get("op") == "tool" and ours is not None:
                        answers += op.get("data", "").encode()
            elif fd == WAKE_R:
                os.read(WAKE_R, 512)
            else:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    caps[fd].push(chunk)
                else:
                    caps.pop(fd).finish()
                    os.close(fd)
        if status is None:
            done, st = wait_block(pid, os.WNOHANG)
            if done:
                status = st
                ended = monotonic()
                deadline = ended + 0.5
        elif monotonic() >= deadline:
            break
    if status is None:
        _, status = wait_block(pid, 0)
        ended = monotonic()
    # What the block left running is killed now, but for servers; the pipes that a server
    # holds are read to their end here and then drained.
    settle(ended)
    for fd, cap in list(caps.items()):
        # Bounded: a server may write without end.
        os.set_blocking(fd, False)
        try:
            for _ in range(16):
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                cap.push(chunk)
        except OSError:
            pass
        os.set_blocking(fd, True)
        cap.finish()
    drain(list(caps))
    caps.clear()
    reap()
    REAPED.clear()
    if ours is not None:
        ours.close()
    if req.get("transient"):
        try:
            os.unlink(path)
        except OSError:
            pass
    oom = oom_kills() > ooms
    resources = usage.report()
    if SYNC:
        report_changes()
    result = {"code": None, "signal": None, "oom": oom, "resources": resources}
    if os.WIFEXITED(status):
        result["code"] = os.WEXITSTATUS(status)
    else:
        result["signal"] = os.WTERMSIG(status)
    send(b"x", json.dumps(result).encode())
    return stdin_buf


# The workspace as Tandem last saw it: path -> [kind, size, mtime_ns(, executable)], kind f
# (regular file), d (directory) or o (anything else: links, FIFOs).
MANIFEST = {}
# More entries than this are not listed one by one: Tandem copies the whole workspace.
MAX_LISTED = 100000
# A change list longer than this goes as "all" (a frame holds at most 1 MiB).
MAX_REPORT = 512 * 1024
# Changed files are sent inline, as a tar in `a` frames, when they come to no more than this
# (and no more than INLINE_FILES of them): one engine round trip per file costs far more.
INLINE_BYTES = 256 * 1024
INLINE_FILES = 64


def inline_tar(changed):
    """A tar of the changed regular files, read as the blocks' user without following
    links; None when they are too many or too large, or one cannot be read."""
    files = [(p, v) for p, v in changed.items() if v[0] == "f"]
    if not files:
        return None
    if len(files) > INLINE_FILES or sum(v[1] for _, v in files) > INLINE_BYTES:
        return None
    out = io.BytesIO()
    try:
        with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for path, _ in files:
                fd = os.open(os.path.join(WORKSPACE, path), os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    executable = os.fstat(f.fileno()).st_mode & 0o111
                    data = f.read(INLINE_BYTES + 1)
                if len(data) > INLINE_BYTES:
                    return None
                info = tarfile.TarInfo(path)
                info.size = len(data)
                # The executable bit travels, as in every copy Tandem makes; no other bit does.
                info.mode = 0o755 if executable else 0o644
                tar.addfile(info, io.BytesIO(data))
    except (OSError, ValueError, UnicodeError):
        return None
    return out.getvalue()


def scan_as_user(previous):
    """The workspace's entries that differ from `previous`, read as the blocks' user (the
    runner has no right to read what they made private); all of them, and all=True, when
    some could not be read or named."""
    found, complete = {}, True
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(os.path.join(WORKSPACE, rel) if rel else WORKSPACE) as it:
                for e in it:
                    r = rel + "/" + e.name if rel else e.name
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        found[r] = ["d", 0, 0]
                        stack.append(r)
                    elif stat.S_ISREG(st.st_mode):
                        # The executable bit too: a chmod alone is a change to copy out.
                        found[r] = ["f", st.st_size, st.st_mtime_ns, bool(st.st_mode & 0o111)]
                    else:
                        found[r] = ["o", 0, 0]
                    if len(found) > MAX_LISTED:
                        return {"all": True, "set": {}, "removed": []}
        except OSError:
            complete = False
    try:
        json.dumps(list(found)).encode("utf-8")
    except UnicodeEncodeError:  # a name that is not UTF-8
        complete = False
    if not complete:
        return {"all": True, "set": found, "removed": []}
    changed = {r: v for r, v in found.items() if previous.get(r) != v}
    removed = [r for r in previous if r not in found]
    return {"all": False, "set": changed, "removed": removed, "inline": inline_tar(changed)}


def changes():
    """What the last block changed, from a child that is the blocks' user; the runner's
    MANIFEST is brought up to date."""
    def scan():
        diff = scan_as_user(MANIFEST)
        tar = diff.pop("inline", None) or b""
        head = json.dumps(diff).encode("utf-8", "surrogateescape")
        return struct.pack(">I", len(head)) + head + tar

    data = as_user(scan)
    try:
        (size,) = struct.unpack(">I", data[:4])
        diff = json.loads(data[4 : 4 + size])
        diff["inline"] = data[4 + size :] or None
    except (ValueError, struct.error):
        diff = {"all": True, "set": {}, "removed": [], "inline": None}
    if diff["all"]:
        MANIFEST.clear()
    for path in diff["removed"]:
        MANIFEST.pop(path, None)
    MANIFEST.update(diff["set"])
    return diff


def report_changes():
    diff = changes()
    if not diff["all"] and not diff["set"] and not diff["removed"]:
        return
    report = {
        "all": diff["all"],
        "changed": [[p, v[0]] for p, v in diff["set"].items()],
        "removed": diff["removed"],
        "inline": bool(diff["inline"]) and not diff["all"],
    }
    payload = json.dumps(report).encode()
    if diff["all"] or len(payload) > MAX_REPORT:
        payload = json.dumps({"all": True, "changed": [], "removed": [], "inline": False}).encode()
    elif report["inline"]:
        tar = diff["inline"]
        for i in range(0, len(tar), 1 << 16):
            send(b"a", tar[i : i + (1 << 16)])
    send(b"c", payload)


def wipe(release_only):
    """Makes the workspace removable by its owner on the host (release), or empties it; as
    the blocks' user, in a child, since the files are theirs."""
    pid = os.fork()
    if pid:
        os.waitpid(pid, 0)
        return
    try:
        drop_privileges()
        wipe_as_user(release_only)
    finally:
        os._exit(0)


def wipe_as_user(release_only):
    for root, dirs, files in os.walk(WORKSPACE):
        for name in dirs + files:
            p = os.path.join(root, name)
            try:
                st = os.lstat(p)
                if not stat.S_ISLNK(st.st_mode):
                    # Open to its owner on the host; a file keeps its executable bit.
                    runnable = name in dirs or st.st_mode & 0o111
                    os.chmod(p, 0o777 if runnable else 0o666)
            except OSError:
                pass
    if not release_only:
        for name in os.listdir(WORKSPACE):
            p = os.path.join(WORKSPACE, name)
            try:
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    os.unlink(p)
            except OSError:
                pass



def egress_relay(path, port):
    """The sandbox's one way out: a connection to its own loopback port goes on to the egress
    proxy's socket, bound in from the host. A sandbox behind the proxy has no other route."""
    import socket, threading, time

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(256)
    # Each relayed connection is two threads of the runner's; a block that opens thousands
    # must not use up the sandbox's pids for its own next block.
    slots = threading.BoundedSemaphore(128)

    def pipe(a, b):
        try:
            while True:
                data = a.recv(1 << 18)
                if not data:
                    break
                b.sendall(data, socket.MSG_NOSIGNAL)
        except OSError:
            pass
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def serve(client):
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upstream.connect(path)
            back = threading.Thread(target=pipe, args=(upstream, client), daemon=True)
            back.start()
            pipe(client, upstream)
            back.join()
        except (OSError, RuntimeError):
            pass
        finally:
            client.close()
            upstream.close()
            slots.release()

    def accept():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                time.sleep(0.1)
                continue
            if not slots.acquire(blocking=False):
                client.close()
                continue
            try:
                threading.Thread(target=serve, args=(client,), daemon=True).start()
            except RuntimeError:
                client.close()
                slots.release()

    threading.Thread(target=accept, daemon=True).start()


from time import monotonic

WAKE_R, WAKE_W = os.pipe()
os.set_blocking(WAKE_W, False)
signal.set_wakeup_fd(WAKE_W)
signal.signal(signal.SIGCHLD, lambda *_: None)
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
if os.getuid() != 0:
    # Started as the blocks' own user (a pod that runs as non-root): what keeps a block from
    # opening /proc/<runner>/fd/1 to forge frames, reading its requests on fd 0 or tracing it
    # is that the runner is not dumpable, which makes its /proc entries root's. A block gets
    # its own flag back when it execs. Such a sandbox's init may reap nothing (`sleep` as a
    # pod's main process), so the runner also takes in what a block's processes orphan.
    import ctypes

    PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        send(b"!", b"cannot make the runner undumpable")
        os._exit(1)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
if SYNC and os.getuid() == 0:
    # A new volume is root's; the blocks' user must be able to write it, and the runner,
    # its owner, may open it up without any capability.
    try:
        os.chmod(WORKSPACE, 0o777)
    except OSError as e:
        send(b"!", ("cannot open the workspace to the blocks' user: %s" % e).encode())
if os.environ.get("TANDEM_EGRESS_SOCKET"):
    try:
        egress_relay(os.environ["TANDEM_EGRESS_SOCKET"], int(os.environ.get("TANDEM_EGRESS_PORT", "3128")))
    except (OSError, ValueError) as e:
        send(b"!", ("cannot reach the egress proxy: %s" % e).encode())
        os._exit(1)
threading.Thread(target=drainer, daemon=True).start()
# A runner started again in a sandbox whose last runner died (a pod is not restarted for it)
# finds what that runner's last block left running; Tandem's relays stay.
kill_block()
send(b"R", json.dumps({"python": sys.version.split()[0]}).encode())
buf = b""
while True:
    while b"\n" not in buf:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            kill_all()
            os._exit(0)
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    if not line.strip():
        continue
    try:
        req = json.loads(line)
        op = req.get("op")
        if op == "run":
            buf = run(req, buf)
        elif op == "rescan":
            changes()
            send(b"d")
        elif op in ("wipe", "release"):
            kill_all()
            wipe(op == "release")
            send(b"d")
        elif op != "kill":
            send(b"!", ("unknown request %r" % op).encode())
    except Exception as e:  # a bad request must not end the session
        send(b"!", ("%s: %s" % (type(e).__name__, e)).encode())
