# Tandem's kept Python interpreter: runs as one long block of its session, and runs each
# Python block sent to it in the same globals, as a notebook does. It talks over three FIFOs
# in .tandem/ of the workspace, opened in this order: `in` (frames of code from Tandem),
# `out` (frames to Tandem: the block's output as it comes, then a `done` record), `ctl`
# (one byte per interrupt). A frame is a 4-byte big-endian length, a kind byte, and data.
# A frame of code that starts with a NUL byte (which no Python source holds) is a command:
# `\0save` pickles the globals and answers with `p` frames (the pickle) and a `d` record
# naming what was saved and what was not. A pickle Tandem placed at .tandem-state.pickle
# is loaded at start, here in the sandbox: the daemon never loads one.
import builtins, importlib, io, json, linecache, os, pickle, signal, struct, sys, threading, traceback, types

D = ".tandem"
STATE = ".tandem-state.pickle"
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


def counts():
    """CPU seconds of this interpreter and the children it reaped, and bytes it caused to
    be written, so far."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    written = None
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k == "write_bytes":
                    written = int(v)
    except (OSError, ValueError):
        pass
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, written


def reset_peak():
    """Resets this process's peak resident set (Linux's clear_refs 5); False where the
    kernel or the sandbox does not let it, and the peak is then the interpreter's so far."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes():
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def used(before, own_peak):
    """What one block used: the counts since `before`, and the peak."""
    cpu, written = counts()
    out = {
        "cpu_secs": round(max(cpu - before[0], 0.0), 6),
        "peak_memory_bytes": peak_bytes(),
        "peak_memory_scope": "block" if own_peak else "session",
        "source": "getrusage",
    }
    if written is not None and before[1] is not None:
        out["disk_written_bytes"] = max(written - before[1], 0)
    else:
        out["unavailable"] = "the kernel keeps no I/O counts here (/proc/self/io)"
    return out


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


class StatePickler(pickle.Pickler):
    """The standard pickler, with modules saved as their import, and refusing what it would
    save by name only: a function or class defined in a block (`__main__`) is not there on a
    restore until that block runs again."""

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType):
            return (importlib.import_module, (obj.__name__,))
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            raise pickle.PicklingError(
                "%s is defined in a block, and the standard pickle saves it by name only: run its definition again after a restore"
                % getattr(obj, "__qualname__", "it")
            )
        return NotImplemented


def extra_pickler():
    for name in ("cloudpickle", "dill"):
        try:
            return importlib.import_module(name)
        except BaseException:
            pass
    return None


def save_state():
    values, saved, not_saved = {}, [], []
    extra = None
    for name, value in list(main.__dict__.items()):
        if name.startswith("__") and name.endswith("__"):
            continue
        buf = io.BytesIO()
        try:
            StatePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
            values[name] = buf.getvalue()
            saved.append(name)
            continue
        except KeyboardInterrupt:
            raise
        except BaseException as e:
            why = "%s: %s" % (type(e).__name__, e)
        extra = extra or extra_pickler()
        if extra is not None:
            try:
                values[name] = extra.dumps(value)
                saved.append(name)
                continue
            except KeyboardInterrupt:
                raise
            except BaseException as e:
                why = "%s (and %s: %s: %s)" % (why, extra.__name__, type(e).__name__, e)
        not_saved.append({"name": name, "why": why[:500]})
    return pickle.dumps({"values": values, "not_saved": not_saved}, protocol=pickle.HIGHEST_PROTOCOL), saved, not_saved


def command(body):
    if body != b"\0save":
        send(ord("d"), json.dumps({"error": "unknown command %r" % body[:40]}).encode())
        return
    try:
        running.set()
        try:
            data, saved, not_saved = save_state()
        finally:
            running.clear()
    except BaseException as e:
        send(ord("d"), json.dumps({"error": "%s: %s" % (type(e).__name__, e)}).encode())
        return
    for at in range(0, len(data), 1 << 20):
        send(ord("p"), data[at:at + (1 << 20)])
    send(ord("d"), json.dumps({"saved": saved, "not_saved": not_saved}).encode())


def restore_state():
    """Loads the globals a snapshot kept, each on its own; answers what the model is told."""
    try:
        fd = os.open(STATE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        return "[tandem] the snapshot's globals could not be read: %s\n" % e
    try:
        os.unlink(STATE)
    except OSError:
        pass
    try:
        with os.fdopen(fd, "rb") as f:
            kept = pickle.load(f)
        values, not_saved = kept["values"], kept["not_saved"]
    except BaseException as e:
        return "[tandem] the snapshot's globals could not be read: %s: %s\n" % (type(e).__name__, e)
    restored, failed = [], []
    for name, data in values.items():
        try:
            main.__dict__[name] = pickle.loads(data)
            restored.append(name)
        except BaseException as e:
            failed.append("%s (%s: %s)" % (name, type(e).__name__, e))
    for item in not_saved:
        failed.append("%s (not saved: %s)" % (item["name"], item["why"]))
    note = "[tandem] restored from the snapshot: %s\n" % (", ".join(restored) or "no globals")
    if failed:
        note += "[tandem] not restored, define again if needed: %s\n" % "; ".join(failed)
    return note


sys.meta_path.insert(0, ShowWatch())
main = types.ModuleType("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
restored_note = restore_state()
saved = (os.dup(1), os.dup(2))
n = 0
while True:
    head = read_exact(inp, 4)
    if head is None:
        os._exit(0)
    body = read_exact(inp, struct.unpack(">I", head)[0])
    if body is None:
        os._exit(0)
    if body[:1] == b"\0":
        command(body)
        continue
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
    before, own_peak = counts(), reset_peak()
    if restored_note:
        # The first block after a restore tells the model which globals came back.
        print(restored_note, end="", file=sys.stderr)
        restored_note = None
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
    send(
        ord("d"),
        json.dumps({"status": status, "exit_code": exit_code & 0xFF, "resources": used(before, own_peak)}).encode(),
    )
