# What every program that runs Python blocks shares (the local fork server, the Docker and
# Kubernetes runner's boot, the kept interpreter), prepended to its own code so that they
# behave as one: a script run as `python3 script` runs it, and the figures it shows kept as
# pictures. Comments only, no triple quotes: the runner carries it in a string.
import os, sys


# Finds matplotlib.pyplot for the import system and wraps its show(), so that a figure
# shown (which draws nothing without a screen) can be saved as a picture.
class ShowWatch:
    shown = False

    def find_spec(self, name, path, target=None):
        if name != "matplotlib.pyplot":
            return None
        sys.meta_path.remove(self)
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            real = module.show

            def show(*args, **kwargs):
                ShowWatch.shown = True
                return real(*args, **kwargs)

            module.show = show

        spec.loader.exec_module = exec_module
        return spec


# Figures shown (plt.show()) are saved as figure-N.png in the workspace, as a notebook shows
# them; a figure only saved with savefig is that file.
def save_figures():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None or not ShowWatch.shown:
        return
    ShowWatch.shown = False
    n = 1
    for num in plt.get_fignums():
        while os.path.exists("figure-%d.png" % n):
            n += 1
        plt.figure(num).savefig("figure-%d.png" % n)
        plt.close(num)


# Runs `script` as `python3 script` would: its own __main__, argv and sys.path[0] (then
# `extra_path`, which a fresh interpreter would have read from PYTHONPATH), its traceback
# without this frame, its exit code; then saves the figures it showed, runs atexit and ends
# the process. Never returns.
def run_as_main(script, extra_path=()):
    import builtins, types

    code = 1
    try:
        sys.argv = [script]
        sys.path[0] = os.path.dirname(script)
        for n, extra in enumerate(extra_path):
            sys.path.insert(1 + n, extra)
        sys.meta_path.insert(0, ShowWatch())
        main = types.ModuleType("__main__")
        main.__file__ = script
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        with open(script, "rb") as f:
            source = f.read()
        exec(compile(source, script, "exec"), main.__dict__)
        code = 0
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        etype, value, tb = sys.exc_info()
        # The script's own frames only, as when python3 runs it itself.
        tb = tb.tb_next if tb is not None else None
        sys.excepthook(etype, value.with_traceback(tb), tb)
        code = 1
    finally:
        try:
            save_figures()
        except BaseException:
            import traceback

            traceback.print_exc()
        try:
            if "threading" in sys.modules:
                sys.modules["threading"]._shutdown()
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code & 0xFF)
