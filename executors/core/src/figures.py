# Figures a Python block shows, kept as pictures: prepended to each program that runs Python
# blocks (the local fork server, the Docker runner's boot, the kept interpreter), so the three
# behave as one. Comments only, no triple quotes: the Docker runner carries it in a string.
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
