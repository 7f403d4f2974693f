# Tandem's Python fork server: one interpreter that has already paid for start-up (site,
# encodings) forks a fresh process per block; a block in another language is exec'd from
# such a fork, so that every block runs under a waiter that is its subreaper. Requests
# arrive on fd 3, a SOCK_SEQPACKET socket: one JSON message with three fds (stdout, stderr,
# status pipes), a fourth, the session's Landlock ruleset, when the block is to be
# confined, and last the block's end of its tools channel when it has one; the reply is the pid of the block's waiter. On the status pipe the block
# writes its own pid once it leads its own session, then the waiter writes the block's raw
# wait status, `usage` and what the block used as JSON, and `kept` when servers the block
# left listening run on; EOF follows once
# every process the block started is dead, or kept.
#
# A request {"op": "hold"} (one fd: the holder's end of its control socket) starts a
# session's holder instead: a process that makes the session's network namespace, keeps it,
# relays its loopback port 3128 to the egress proxy when the session is behind one, and on
# its control socket dials the session's ports and lists them. Its blocks join that
# namespace; servers they leave listening outlive them until the holder ends (the Rust side
# closes its socket when the session closes). The reply is `ok` or `!` and the reason.
import _thread, fcntl, io, json, os, resource, select, signal, socket, struct, sys, time

ctl = socket.socket(fileno=3)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the waiters are reaped by the kernel

try:
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (ImportError, OSError, AttributeError):
    _prctl = None
PR_SET_CHILD_SUBREAPER = 36


def block(req, out, err, status):
    """The block's own process: set up like a fresh `python3 script` and run it."""
    try:
        os.setsid()
        if req.get("confine"):
            scope_away_from_waiter()
        report_pid(status, os.getpid())
        os.close(status)
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for f in (fd, out, err):
            if f > 2:
                os.close(f)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
        )
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if not req["env"].get("PYTHONNOUSERSITE"):
            # A fresh interpreter finds its user's site under HOME (the workspace, where
            # `pip install --user` puts packages); the server started with another HOME.
            import site

            site.USER_BASE = None
            site.USER_SITE = None
            site.ENABLE_USER_SITE = True
            user_site = site.getusersitepackages()
            if os.path.isdir(user_site) and user_site not in sys.path:
                site.addsitedir(user_site)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    # PYTHONPATH is read once at start-up by a fresh interpreter; this one started before
    # the block.
    run_as_main(req["script"], [p for p in req["env"].get("PYTHONPATH", "").split(":") if p])


def children(me):
    """Pids whose parent is `me` (orphans of the block land here: we are a subreaper)."""
    try:
        with open("/proc/%d/task/%d/children" % (me, me)) as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name) as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def kill_descendants():
    """Kills every process left behind, including daemons that left the block's session:
    as a subreaper, this process inherits each one whose parent dies."""
    me = os.getpid()
    while True:
        for pid in children(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return
        os.sched_yield()


# Python ignores these; a block's programs start with them as a fresh process has them.
FRESH_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD)


# A confined block's program waits behind this gate until the waiter says go: `read` on fd
# 3 returns once the spawning thread (the one task of the waiter inside the block's domain,
# which the block could otherwise signal, and so kill the whole waiter) is gone.
GATE = (
    'read -r _ <&3; [ -x "$1" ] || { echo "tandem: cannot start $1: not an executable file" >&2; exit 127; }; '
    'exec "$@" 3<&-'
)

# ...and a shell block is run by the gate's shell itself, with $0 the script as `sh script`
# has it.
SH_GATE = 'read -r _ <&3; exec 3<&-; . "$0"'


def spawn_scoped(req, out, err, status):
    """Another language's confined block, spawned from a thread of this waiter that first
    enters the Landlock domain keeping it from signalling the waiter: Landlock restricts the
    calling thread only, so the waiter itself stays outside, and posix_spawn keeps its speed
    (a fork of this interpreter costs about 2 ms more per block). Until that thread has
    ended, the block is held at a gate (a shell reading fd 3, which then runs the program):
    before, nothing of the block's own runs."""
    found = []
    done = _thread.allocate_lock()
    done.acquire()
    gate_r, gate_w = os.pipe()
    if gate_r <= 3:
        # Above every fd the spawn moves, so that it can land at 3 last.
        high = fcntl.fcntl(gate_r, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(gate_r)
        gate_r = high
    argv = list(req["argv"])
    if len(argv) == 2 and os.path.basename(argv[0]) in ("sh", "dash"):
        # A shell block is sourced by the gate's own shell: one exec, not two.
        gated = dict(req, argv=[argv[0], "-c", SH_GATE, argv[1]])
    else:
        gated = dict(req, argv=["/bin/sh", "-c", GATE, "tandem-gate"] + argv)

    def run():
        try:
            found.append(_thread.get_native_id())
            scope_away_from_waiter()
            found.append(spawn_plain(gated, out, err, status, gate=gate_r))
        except BaseException as e:
            found.append(e)
        finally:
            done.release()

    _thread.start_new_thread(run, ())
    done.acquire()
    os.close(gate_r)
    # The thread has released the lock; wait for the kernel to have ended it.
    task = "/proc/self/task/%d" % found[0]
    while os.path.exists(task):
        os.sched_yield()
    os.write(gate_w, b"go\n")
    os.close(gate_w)
    if isinstance(found[1], BaseException):
        raise found[1]
    return found[1]


def spawn(req, out, err, status):
    if req.get("confine") and SIGNAL_SCOPE:
        return spawn_scoped(req, out, err, status)
    return spawn_plain(req, out, err, status)


def spawn_plain(req, out, err, status, gate=None):
    """Another language's block: exec'd by posix_spawn (vfork, no copy of this interpreter)
    in its own session, with the signal dispositions a fresh process has; `gate`, when
    given, becomes its fd 3."""
    os.chdir(req["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    argv = req["argv"]
    # In order: the three streams, then every original closed (one of them may be fd 3),
    # then the gate at 3.
    actions = [
        (os.POSIX_SPAWN_DUP2, null, 0),
        (os.POSIX_SPAWN_DUP2, out, 1),
        (os.POSIX_SPAWN_DUP2, err, 2),
    ] + [(os.POSIX_SPAWN_CLOSE, fd) for fd in (null, out, err, status) if fd > 2]
    if gate is not None:
        actions += [(os.POSIX_SPAWN_DUP2, gate, 3), (os.POSIX_SPAWN_CLOSE, gate)]
    try:
        pid = os.posix_spawn(
            argv[0],
            argv,
            req["env"],
            setsid=True,
            setsigdef=FRESH_SIGNALS,
            file_actions=actions,
        )
    except OSError as e:
        # Reported as the block's own failure, by a process that keeps the pipe's protocol.
        pid = os.fork()
        if pid == 0:
            os.setsid()
            report_pid(status, os.getpid())
            os.write(err, ("tandem: cannot start %s: %s\n" % (argv[0], e)).encode())
            os._exit(127)
        return pid
    # It already leads its own session: a kill from now on cannot miss it.
    report_pid(status, pid)
    os.close(null)
    return pid


CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000, 0x20000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000

# Set in the init of a block's own PID namespace: the pid that the Rust side kills is then
# that init's (reported from outside, where pids mean something to it), not the block's.
IN_PID_NAMESPACE = False


def report_pid(status, pid):
    """Tells the Rust side which pid leads the block's process group, unless the block has a
    PID namespace of its own (then its init, whose death takes every process in it, was
    reported already)."""
    if not IN_PID_NAMESPACE:
        os.write(status, b"%d\n" % pid)


class Refused(Exception):
    """The kernel would not confine the block: it must not run."""


def check(ret, what):
    if ret < 0:
        raise Refused("%s: %s" % (what, os.strerror(ctypes.get_errno())))
    return ret


if _prctl is not None:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syscall.restype = ctypes.c_long

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def write_id_maps(uid, gid):
    for name, text in (("uid_map", "%d %d 1" % (uid, uid)), ("setgroups", "deny"), ("gid_map", "%d %d 1" % (gid, gid))):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)


def isolate_network():
    """A new user and network namespace with nothing in it, keeping this user's ids; True
    when the kernel allowed it."""
    uid, gid = os.getuid(), os.getgid()
    if _prctl is None or _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        return False
    write_id_maps(uid, gid)
    return True


# tandem_executor::EGRESS_PORT: where a block behind the egress proxy finds it.
EGRESS_PORT = 3128


def lo_up():
    """Brings up the loopback of this (new) network namespace."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        got = fcntl.ioctl(s, 0x8913, struct.pack("16sH14s", b"lo", 0, b"\0" * 14))  # SIOCGIFFLAGS
        flags = struct.unpack("16sH", got[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b"\0" * 14))  # SIOCSIFFLAGS, IFF_UP
    finally:
        s.close()


def relay_loop(listener, path):
    """Carries each connection to the block's loopback port on to the proxy's socket."""
    slots = [64]
    lock = _thread.allocate_lock()

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
        done = _thread.allocate_lock()
        done.acquire()

        def back():
            pipe(upstream, client)
            done.release()

        try:
            upstream.connect(path)
            _thread.start_new_thread(back, ())
            pipe(client, upstream)
            done.acquire()
        except (OSError, RuntimeError):
            pass
        finally:
            client.close()
            upstream.close()
            with lock:
                slots[0] += 1

    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            continue
        with lock:
            free = slots[0] > 0
            if free:
                slots[0] -= 1
        if not free:
            client.close()
            continue
        try:
            _thread.start_new_thread(serve, (client,))
        except RuntimeError:
            client.close()
            with lock:
                slots[0] += 1


# Each hold's network namespace and the read end of its life pipe (EOF once the holder is
# gone), by the id the Rust side gave it.
HOLDS = {}


def holds_except(keep):
    """The fds of every hold but `keep`: a fork closes them, so that no block holds another
    session's network."""
    return [fd for hid, fds in HOLDS.items() if hid != keep for fd in fds]


def forget_dead_holds():
    """Drops the holds whose holder has ended (its life pipe reads EOF). Asked with poll,
    which, unlike select, takes descriptors of any number."""
    if not HOLDS:
        return
    poller = select.poll()
    for _, life in HOLDS.values():
        poller.register(life, select.POLLIN)
    ended = {fd for fd, _ in poller.poll(0)}
    for hid, (net, life) in list(HOLDS.items()):
        if life in ended:
            os.close(net)
            os.close(life)
            del HOLDS[hid]


def table_sockets(state):
    """The inodes of this network namespace's TCP sockets in `state` (hex, as the kernel
    writes it), by local port."""
    found = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == state:
                        found[cols[9]] = int(cols[1].rsplit(":", 1)[1], 16)
        except (OSError, ValueError):
            pass
    return found


def dial_local(port):
    """A connection to `port` on this namespace's loopback (IPv4, then IPv6), or why not."""
    why = "nothing listens on it"
    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect((host, port))
            s.settimeout(None)
            return s, None
        except OSError as e:
            s.close()
            if family == socket.AF_INET and not isinstance(e, ConnectionRefusedError):
                why = e.strerror or str(e)
    return None, why


def serve_holder(conn, skip, listener=None):
    """Answers the Rust side: `dial PORT` with the connected socket (or `!` and why), `list`
    with the ports listened on (JSON), `listener` with the egress listener (once: the proxy
    serves it from then on), `netns` with the session's network namespace (for the proxy to
    catch what goes around it), until it closes its end."""
    while True:
        try:
            msg = conn.recv(256)
        except InterruptedError:
            continue
        except OSError:
            return
        if not msg:
            return
        words = msg.split()
        try:
            if words[:1] == [b"dial"] and len(words) == 2:
                s, why = dial_local(int(words[1]))
                if s is None:
                    conn.send(b"!" + why.encode())
                else:
                    socket.send_fds(conn, [b"ok"], [s.fileno()])
                    s.close()
            elif words == [b"listener"]:
                if listener is None:
                    conn.send(b"!this session has no egress listener to hand over")
                else:
                    socket.send_fds(conn, [b"ok"], [listener.fileno()])
                    listener.close()
                    listener = None
            elif words == [b"netns"]:
                ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
                try:
                    socket.send_fds(conn, [b"ok"], [ns])
                finally:
                    os.close(ns)
            elif words == [b"list"]:
                ports = set(table_sockets("0A").values()) - skip
                conn.send(json.dumps(sorted(ports)).encode())
            else:
                conn.send(b"!unknown request")
        except (OSError, ValueError) as e:
            try:
                conn.send(("!%s" % e).encode())
            except OSError:
                return


def holder(back):
    """The session's holder (a child of this server): makes the session's network namespace
    ahead of its session (a spare, see `start_hold`), then, given its session's request and
    the Rust side's control socket, sends the server that namespace and the read end of a
    pipe that only this process holds, and serves the Rust side."""
    why = None
    try:
        os.setsid()
        _prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: ends with the server
        for fd in holds_except(None):
            os.close(fd)
        check(_libc.unshare(CLONE_NEWNET), "a network namespace for the session")
        lo_up()
    except BaseException as e:
        why = e
    try:
        msg, fds, _, _ = socket.recv_fds(back, 1 << 16, 2)
        if not msg or not fds:
            return
        for fd in fds[1:]:
            os.close(fd)
        if why is not None:
            raise why
        req = json.loads(msg)
        skip = set()
        listener = None
        if req.get("egress"):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", EGRESS_PORT))
            listener.listen(128)
            skip.add(EGRESS_PORT)
        life_r, life_w = os.pipe()
        net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        socket.send_fds(back, [b"ok"], [net, life_r])
        os.close(net)
        os.close(life_r)
        back.close()
        if listener is not None and not req.get("adopt"):
            _thread.start_new_thread(relay_loop, (listener, req["egress"]))
            listener = None
        serve_holder(socket.socket(fileno=fds[0]), skip, listener)
    except BaseException as e:
        try:
            back.send(("!%s" % e).encode())
        except OSError:
            pass
    finally:
        os._exit(0)


# The next session's holder, started before it is asked for: making a network namespace
# takes milliseconds that would otherwise fall on a session's first block. `None` until the
# first hold (a server whose sessions never hold makes none).
SPARE = None


def spare_holder():
    """Forks a holder that makes its network namespace now and waits for its session; the
    server's end of the socket to it."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        pid = os.fork()
    except OSError:
        mine.close()
        theirs.close()
        raise
    if pid == 0:
        # No other spare's socket is open here: the last one was taken (and closed) first.
        ctl.close()
        mine.close()
        holder(theirs)
    theirs.close()
    return mine


def start_hold(req, fds):
    """Gives a session its holder (the spare, whose namespace is likely made already); the
    reply for the Rust side."""
    global SPARE
    if not ISOLATED or _prctl is None:
        for fd in fds:
            os.close(fd)
        return b"!blocks here share this machine's network (confinement or its user namespace is off)"
    if not fds:
        return b"!no control socket came with the request"
    got = []
    body = json.dumps(req).encode()
    mine, SPARE = SPARE, None
    try:
        # A spare that died (killed from outside) is replaced by a new one, asked at once.
        for last in (mine is None, True):
            if mine is None:
                mine = spare_holder()
            try:
                mine.settimeout(10)
                socket.send_fds(mine, [body], fds[:1])
                break
            except OSError:
                mine.close()
                mine = None
                if last:
                    raise
        msg, got, _, _ = socket.recv_fds(mine, 4096, 2)
    except OSError as e:
        msg = ("!%s" % e).encode()
    finally:
        if mine is not None:
            mine.close()
    for fd in fds:
        os.close(fd)
    ok = msg == b"ok" and len(got) == 2
    if ok:
        for fd in got:
            os.set_inheritable(fd, False)
        HOLDS[req["id"]] = got
    else:
        for fd in got:
            os.close(fd)
    return b"ok" if ok else (msg or b"!the session's holder ended as it started")


def refill_spare():
    """Starts the next spare holder, once the last hold is answered (the Rust side goes on
    meanwhile) and is in HOLDS (so that the spare closes it with the others)."""
    global SPARE
    if SPARE is None and ISOLATED and _prctl is not None:
        try:
            SPARE = spare_holder()
        except OSError:
            SPARE = None


def join_hold(fds):
    """Moves this waiter into its session's network namespace; returns the life pipe."""
    net, life = fds
    check(_libc.setns(net, CLONE_NEWNET), "joining the session's network namespace")
    os.close(net)
    return life


def others():
    """Every process of this PID namespace but its init (this process)."""
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and n != "1"]


def reap():
    try:
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass
    except ChildProcessError:
        pass


def listening(pids):
    """Those of `pids` that hold a listening TCP socket of this network namespace."""
    sockets = {"socket:[%s]" % inode for inode in table_sockets("0A")}
    found = set()
    if not sockets:
        return found
    for pid in pids:
        base = "/proc/%d/fd" % pid
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            try:
                if os.readlink(base + "/" + name) in sockets:
                    found.add(pid)
                    break
            except OSError:
                pass
    return found


def keep_servers(ended):
    """In the init of a finished block's PID namespace: keeps the processes that listen (one
    still starting gets until half a second after `ended`) and kills the rest, each pass
    stopping what it finds before killing it. True when servers are kept."""
    if not others():
        return False
    while True:
        keep = listening(others())
        if keep or time.monotonic() >= ended + 0.5:
            break
        time.sleep(0.05)
    for _ in range(100):
        left = [p for p in others() if p not in keep]
        if not left:
            return bool(keep)
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for p in left:
                try:
                    os.kill(p, sig)
                except OSError:
                    pass
        reap()
    return False


def serve_kept(life):
    """Reaps the kept servers' orphans until none is left or the session's holder ends; the
    init's exit then ends every process of the namespace."""
    poller = select.poll()
    poller.register(life, select.POLLIN)
    while True:
        if poller.poll(1000):
            return
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return


# With the network off, the server itself leaves the network once: every block it forks is
# then in a namespace with no interfaces, at no cost per block.
ISOLATED = "--no-network" in sys.argv[1:] and isolate_network()
# Seccomp programs by their hex, decoded by the server so its forks need not.
SECCOMP = {}


def seccomp_program(text):
    program = SECCOMP.get(text)
    if program is None and _prctl is not None:
        program = SECCOMP[text] = ctypes.create_string_buffer(bytes.fromhex(text))
    return program


def confine(c, fd):
    """Confines this waiter, and so the block it starts: a network namespace (the server's,
    or one of its own; failing that, the ruleset's TCP rules) unless the network is allowed,
    the session's Landlock ruleset `fd` (made by Tandem), no new privileges, and the seccomp
    program. A step the kernel refuses raises Refused."""
    if fd is None:
        raise Refused("no Landlock ruleset came with the request")
    if _prctl is None:
        raise Refused("this Python has no ctypes")
    if not c["network"] and not ISOLATED and not isolate_network() and not c["tcp"]:
        raise Refused("no network namespace and no Landlock TCP rules")
    check(_prctl(38, 1, 0, 0, 0), "no_new_privs")  # PR_SET_NO_NEW_PRIVS
    check(_libc.syscall(446, fd, 0), "landlock restrict")
    os.close(fd)
    program = seccomp_program(c["seccomp"])
    if len(program) > 1:
        # create_string_buffer adds a NUL: the program is len - 1 bytes.
        fprog = Fprog((len(program) - 1) // 8, ctypes.cast(program, ctypes.c_void_p))
        check(_libc.prctl(22, 2, ctypes.byref(fprog), 0, 0), "seccomp")  # PR_SET_SECCOMP, FILTER


def enter_pid_namespace():
    """Makes the next fork the init of a new PID namespace, in a mount namespace of its own
    whose mounts do not propagate back (and, for a user other than root not yet in a user
    namespace, a user namespace keeping its ids)."""
    if _prctl is None:
        raise Refused("this Python has no ctypes")
    flags = CLONE_NEWPID | CLONE_NEWNS
    user = os.geteuid() != 0 and not ISOLATED
    if user:
        flags |= CLONE_NEWUSER
    uid, gid = os.getuid(), os.getgid()
    check(_libc.unshare(flags), "a PID namespace")
    if user:
        write_id_maps(uid, gid)
    check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "private mounts")


def own_proc(rules):
    """In the init of the block's PID namespace: a `/proc` that shows this namespace only,
    over the host's, readable under the block's Landlock ruleset `rules` (its rule for the
    host's `/proc` does not reach a new mount)."""
    check(_libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "a /proc of its own")
    fd = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        rule = struct.pack("=Qi", 1 | 4 | 8, fd)  # execute, read a file, read a directory
        check(_libc.syscall(445, rules, 1, rule, 0), "a Landlock rule for the new /proc")
    finally:
        os.close(fd)


def pid_namespace(req, out, err, status, rules):
    """Runs the rest of this waiter as the init of the block's own PID namespace (returns
    there); this process waits for that init and exits. Where the kernel refuses and the
    namespace is not required, returns here and the block runs without one."""
    global IN_PID_NAMESPACE
    required = req["confine"].get("pid_namespace") == "required"
    if not PID_NAMESPACES:
        if required:
            raise Refused("this kernel does not let Tandem make a PID namespace with its own /proc")
        return
    enter_pid_namespace()
    # The init's pid must be the first line on the status pipe: the init holds still until
    # it is written (a fast block would otherwise end first, and its wait status be taken
    # for the pid to kill).
    hold_r, hold_w = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(hold_w)
        os.read(hold_r, 1)
        os.close(hold_r)
        IN_PID_NAMESPACE = True
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        try:
            own_proc(rules)
        except (Refused, OSError) as e:
            # Never run on in a namespace whose /proc is the host's: pids read there would
            # name the host's processes. (The start-up probe makes this rare.)
            raise Refused(str(e))
        return
    # Whichever of the two setpgid calls comes first, the init leads its own group before
    # its pid is reported, so a kill from then on cannot miss it (and its death ends every
    # process in its namespace).
    try:
        os.setpgid(init, init)
    except OSError:
        pass
    # "ns": the Rust side kills this init alone, whose death ends every process in its
    # namespace, and scans no /proc for strays (none can leave a PID namespace).
    os.write(status, b"%d ns\n" % init)
    os.close(hold_r)
    os.close(hold_w)
    for fd in (out, err, status, rules):
        if fd is not None:
            os.close(fd)
    try:
        os.waitpid(init, 0)
    except ChildProcessError:
        pass
    os._exit(0)


def probe_pid_namespaces():
    """Whether a waiter here can make a PID namespace whose init mounts its own /proc: tried
    once, in a throwaway child, at start."""
    if _prctl is None:
        return False
    pid = os.fork()
    if pid == 0:
        try:
            enter_pid_namespace()
            init = os.fork()
            if init == 0:
                ok = _libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0
                os._exit(0 if ok and os.getpid() == 1 else 1)
            os._exit(os.waitstatus_to_exitcode(os.waitpid(init, 0)[1]))
        except BaseException:
            os._exit(1)
    try:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    except ChildProcessError:
        return False


# Landlock scopes signals from ABI 6 on.
SIGNAL_SCOPE = _prctl is not None and _libc.syscall(444, None, 0, 1) >= 6


def scope_away_from_waiter():
    """Puts this block in a Landlock domain of its own inside the waiter's, which only scopes
    signals: the block can no longer kill the waiter that kills what it leaves behind."""
    if not SIGNAL_SCOPE:
        return
    attr = struct.pack("=QQQ", 0, 0, 2)  # LANDLOCK_SCOPE_SIGNAL
    fd = _libc.syscall(444, attr, len(attr), 0)
    if fd >= 0:
        _libc.syscall(446, fd, 0)
        os.close(fd)


def usage():
    """What the block and every process it left (this waiter, their subreaper, reaped them
    all) used: the kernel adds a reaped child's CPU time, peak and I/O counts to its
    reaper's. The peak is the largest single process's resident set, not their sum."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {
        "cpu_secs": round(r.ru_utime + r.ru_stime, 6),
        "peak_memory_bytes": r.ru_maxrss * 1024,
        "peak_memory_scope": "block",
        "source": "getrusage",
    }
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k == "write_bytes":
                    out["disk_written_bytes"] = int(v)
    except (OSError, ValueError):
        out["unavailable"] = "the kernel keeps no I/O counts here (/proc/self/io)"
    return out


def waiter(req, out, err, status, rules=None, hold=None):
    """Start the block, wait for it, clean up after it, report its raw wait status."""
    life = None
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if _prctl is not None:
            _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if req.get("hold") is not None:
            try:
                if hold is None:
                    raise Refused("its holder has ended")
                life = join_hold(hold)
            except (Refused, OSError) as e:
                report_pid(status, os.getpid())
                os.write(err, ("tandem: cannot give the block its session's network: %s\n" % e).encode())
                os.write(status, b"%d\n" % (127 << 8))
                return
        for name, limit in req["rlimits"]:
            resource.setrlimit(getattr(resource, name), (limit, limit))
        if req.get("confine"):
            try:
                if req["confine"].get("pid_namespace"):
                    pid_namespace(req, out, err, status, rules)
                confine(req["confine"], rules)
            except Exception as e:
                # Nothing runs unconfined that was asked to be confined: the block fails.
                report_pid(status, os.getpid())
                os.write(err, ("tandem: cannot confine the block: %s\n" % e).encode())
                os.write(status, b"%d\n" % (127 << 8))
                return
        if req.get("argv"):
            pid = spawn(req, out, err, status)
        else:
            pid = os.fork()
            if pid == 0:
                if life is not None:
                    os.close(life)
                block(req, out, err, status)
        os.close(out)
        os.close(err)
        _, wstatus = os.waitpid(pid, 0)
        kept = IN_PID_NAMESPACE and life is not None and keep_servers(time.monotonic())
        # In its own PID namespace the block's leftovers die with this init, which exits
        # next (or, keeping servers, once its session's holder ends); outside one, this
        # waiter, their subreaper, kills them.
        if not IN_PID_NAMESPACE:
            kill_descendants()
        os.write(status, b"%d\n" % wstatus)
        os.write(status, b"usage %s\n" % json.dumps(usage()).encode())
        if kept:
            os.write(status, b"kept\n")
            os.close(status)
            serve_kept(life)
    finally:
        os._exit(0)


# Asked before SIGCHLD is ignored below would matter: the probe waits for its child.
signal.signal(signal.SIGCHLD, signal.SIG_DFL)
PID_NAMESPACES = probe_pid_namespaces()
signal.signal(signal.SIGCHLD, signal.SIG_IGN)

while True:
    msg, fds, _, _ = socket.recv_fds(ctl, 1 << 20, 5)
    if not msg:
        os._exit(0)
    req = json.loads(msg)
    forget_dead_holds()
    if req.get("op") == "hold":
        ctl.send(start_hold(req, fds))
        refill_spare()
        continue
    # The block's end of its tools channel comes last; the block and what it starts inherit
    # it, and find it by number.
    if req.get("tools") and len(fds) > 3:
        req["env"]["TANDEM_TOOLS_FD"] = str(fds[-1])
        os.set_inheritable(fds[-1], True)
    if req.get("confine"):
        try:
            seccomp_program(req["confine"]["seccomp"])
        except (ValueError, KeyError):
            pass  # the waiter reports it
    pid = os.fork()
    if pid == 0:
        ctl.close()
        # A block must not reach the spare holder, which would take its word for a session.
        if SPARE is not None:
            SPARE.close()
        for fd in holds_except(req.get("hold")):
            os.close(fd)
        waiter(
            req,
            *fds[:3],
            rules=fds[3] if req.get("confine") and len(fds) > 3 else None,
            hold=HOLDS.get(req.get("hold")),
        )
    for f in fds:
        os.close(f)
    ctl.send(str(pid).encode())
