"""Tandem's pre-initialised Python: the interpreter and common modules are set up when the
component is built, so each block starts from that snapshot instead of booting CPython."""

import atexit
import builtins
import os
import sys
import traceback
import types

import wit_world

# The environment is read when the snapshot is built, not when a block runs.
sys.dont_write_bytecode = True

# Modules LLM-written code commonly uses. Only what is imported here exists at run time.
PRELOAD = """
abc argparse array ast asyncio base64 binascii bisect bz2 calendar cmath codecs collections
collections.abc colorsys concurrent.futures configparser contextlib contextvars copy csv
dataclasses datetime decimal difflib dis email email.mime.text enum errno fnmatch
fractions functools gc getpass glob graphlib gzip hashlib heapq hmac html html.parser
http http.client inspect io ipaddress itertools json keyword linecache locale logging
lzma math mimetypes numbers operator optparse os.path pathlib pickle platform pprint
queue random re reprlib sched secrets select selectors shlex shutil signal socket sqlite3
statistics string stringprep struct subprocess sys tarfile tempfile textwrap threading
time timeit tokenize traceback types typing unicodedata unittest unittest.mock
urllib.parse urllib.request uuid warnings weakref xml.dom.minidom xml.etree.ElementTree
zipfile zlib zoneinfo
""".split()
MISSING = []
for _name in PRELOAD:
    try:
        __import__(_name)
    except Exception as _e:  # not fatal: the build says what is left out
        MISSING.append(f"{_name} ({_e})")
# Codecs are looked up lazily by name, so each one has to be loaded now to exist later.
import encodings
import pkgutil

for _codec in pkgutil.iter_modules(encodings.__path__):
    try:
        __import__(f"encodings.{_codec.name}")
    except Exception:
        pass  # the Windows-only ones
if MISSING:
    print("tandem snapshot: not preloaded:", ", ".join(MISSING), file=sys.stderr)


class _Exit(BaseException):
    """`os._exit(n)` inside a block: WASI preview 2 can only exit with success or failure,
    so the code travels back through `run` instead (`finally` blocks do run on the way)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


def _os_exit(code):
    raise _Exit(code)


os._exit = _os_exit


def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


class WitWorld(wit_world.WitWorld):
    def run(self, path: str) -> int:
        os.chdir("/workspace")
        sys.argv = [path]
        sys.path.insert(0, os.path.dirname(path))
        main = types.ModuleType("__main__")
        main.__file__ = path
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        run_atexit = True
        try:
            with open(path, "rb") as f:
                code = compile(f.read(), path, "exec")
            exec(code, main.__dict__)
            status = 0
        except _Exit as e:
            status = e.code
            run_atexit = False
        except SystemExit as e:
            status = _exit_code(e.code)
        except BaseException as e:
            tb = e.__traceback__
            # Drop this frame, so the traceback is the script's own.
            if tb is not None and tb.tb_frame.f_code is WitWorld.run.__code__:
                tb = tb.tb_next
            traceback.print_exception(type(e), e, tb)
            missing = getattr(e, "name", None) if isinstance(e, ImportError) else None
            if missing and missing.partition(".")[0] in sys.stdlib_module_names:
                print(
                    f"[tandem] `{missing}` is part of the standard library but not of this "
                    "pre-initialised Python; the stock interpreter has it "
                    "([executors.wasm] python = \"stock\")",
                    file=sys.stderr,
                )
            status = 1
        try:
            if run_atexit:
                atexit._run_exitfuncs()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
        return status
