# Tandem's kept Python interpreter: runs as one long block of its session, and runs each
# Python block sent to it in the same globals, as a notebook does. It talks over three FIFOs
# in .tandem/ of the workspace, opened in this order: `in` (frames of code from Tandem),
# `out` (frames to Tandem: the block's output as it comes, then a `done` record), `ctl`
# (one byte per interrupt). A frame is a 4-byte big-endian length, a kind byte, and data.
import builtins, json, linecache, os, signal, struct, sys, threading, traceback, types

D = ".tandem"
inp = os.open(D + "/in", os.O_RDONLY)
out = os.open(D + "/out", os.O_WRONLY)
ctl = os.open(D + "/ctl", os.O_RDONLY)
for name in ("in", "out", "ctl"):
    try:
        os.unlink(D + "/" + name)
    except OSError:
        pass
os.set_inheritable(inp, False)
os.set_inheritable(out, False)
os.set_inheritable(ctl, False)
lock = threading.Lock()


def send(kind, data):
    frame = struct.pack(">IB", len(data), kind) + data
    with lock:
        view = memoryview(frame)
        while view:
            view = view[os.write(out, view):]


def read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        part = os.read(fd, n - len(buf))
        if not part:
            return None
        buf += part
    return buf


running = threading.Event()
MAIN = threading.main_thread().ident
signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupts():
    while True:
        b = os.read(ctl, 1)
        if not b:
            return
        # Only a block is interrupted; one that ended meanwhile has its answer on the way. A
        # real SIGINT to the main thread, so a blocking call (sleep, a read) returns too.
        if running.is_set():
            signal.pthread_kill(MAIN, signal.SIGINT)


threading.Thread(target=interrupts, daemon=True).start()


def pump(fd, kind):
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:
            data = b""
        if not data:
            os.close(fd)
            return
        send(kind, data)


def leftovers():
    """Processes this block started: they end with it, as they do in a fresh process."""
    me = os.getpid()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open("/proc/%s/stat" % name) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == os.getsid(0):
                    found.append(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return found


def clean_up():
    for _ in range(50):
        pids = leftovers()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            pass


sys.meta_path.insert(0, ShowWatch())
main = types.ModuleType("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
saved = (os.dup(1), os.dup(2))
n = 0
while True:
    head = read_exact(inp, 4)
    if head is None:
        os._exit(0)
    body = read_exact(inp, struct.unpack(">I", head)[0])
    if body is None:
        os._exit(0)
    n += 1
    code = body.decode("utf-8", "replace")
    name = "<block %d>" % n
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    readers = [threading.Thread(target=pump, args=(r1, ord("o"))), threading.Thread(target=pump, args=(r2, ord("e")))]
    for t in readers:
        t.start()
    os.dup2(w1, 1)
    os.dup2(w2, 2)
    os.close(w1)
    os.close(w2)
    status, exit_code = "ok", 0
    ShowWatch.shown = False
    try:
        running.set()
        try:
            exec(compile(code, name, "exec"), main.__dict__)
        finally:
            running.clear()
    except SystemExit as e:
        if e.code is None:
            exit_code = 0
        elif isinstance(e.code, int):
            exit_code = e.code
        else:
            print(e.code, file=sys.stderr)
            exit_code = 1
    except KeyboardInterrupt:
        status, exit_code = "interrupted", 1
        etype, value, tb = sys.exc_info()
        traceback.print_exception(etype, value, tb.tb_next if tb else None)
    except BaseException:
        exit_code = 1
        etype, value, tb = sys.exc_info()
        # From the user's code down, as python3 shows it for a script.
        traceback.print_exception(etype, value, tb.tb_next if tb else None)
    try:
        save_figures()
    except BaseException:
        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    clean_up()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for t in readers:
        t.join(2)
    send(ord("d"), json.dumps({"status": status, "exit_code": exit_code & 0xFF}).encode())
