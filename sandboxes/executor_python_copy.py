"""Copy this interpreter, self-contained, into a directory: run by the python3 of an image that has one (the default
sandbox image), inside a throwaway container whose volume is ``/out``, so that sandboxes of images without python3
can mount the copy and run the executor from it (``sandboxes/executor_python.py``).

The copy is the interpreter, its standard library with its extension modules, every shared library those load and
the dynamic loader, laid out as ``current/{ld.so, lib/, python/bin/python3, python/lib/pythonX.Y/}``. Started through
its own loader with ``--library-path`` it needs nothing from the image it runs in. The shared libraries are read from
``/proc/self/maps`` after importing every extension module: exactly what the loader mapped, with no ``ldd``.

Idempotent and safe to run twice at once: a finished copy is never touched again; a new one is made under a
staging name and renamed into place, and a loser of that race throws its own away. Needs only python3 >= 3.8.
"""

import contextlib
import importlib
import os
import shutil
import sys
import sysconfig
import tempfile

OUT = "/out"
CURRENT = os.path.join(OUT, "current")
#: parts of the standard library the executor never imports
SKIPPED = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "__pycache__",
           "site-packages", "dist-packages"}


def loaded_libraries():
    """The shared objects mapped into this process once every extension module it can load is loaded."""
    dynload = sysconfig.get_path("platstdlib")
    for directory in {os.path.join(dynload, "lib-dynload"), os.path.dirname(os.__file__) + "/lib-dynload"}:
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            if name.endswith(".so"):
                with contextlib.suppress(Exception):  # a module whose own library is missing is not needed
                    importlib.import_module(name.split(".")[0])
    paths = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/") and ".so" in fields[5]:
                paths.add(fields[5].strip())
    return paths


def names_of(path):
    """A mapped library's file name and the names that link to it beside it: the loader asks for the soname
    (``libz.so.1``), the map shows the file (``libz.so.1.2.13``)."""
    directory = os.path.dirname(path)
    return {os.path.basename(path)} | {name for name in os.listdir(directory)
                                       if os.path.realpath(os.path.join(directory, name)) == path}


def copy_tree(source, target):
    shutil.copytree(source, target, symlinks=False,
                    ignore=lambda _dir, names: [n for n in names if n in SKIPPED])


def main():
    if os.path.isdir(CURRENT):
        return
    staging = tempfile.mkdtemp(prefix=".staging-", dir=OUT)
    try:
        stdlib = os.path.dirname(os.__file__)
        version = "python{}.{}".format(*sys.version_info[:2])
        os.makedirs(os.path.join(staging, "python", "bin"))
        os.makedirs(os.path.join(staging, "python", "lib"))
        os.makedirs(os.path.join(staging, "lib"))
        shutil.copy2(os.path.realpath(sys.executable), os.path.join(staging, "python", "bin", "python3"))
        copy_tree(stdlib, os.path.join(staging, "python", "lib", version))
        dynload = os.path.join(staging, "python", "lib", version, "lib-dynload")
        if not os.path.isdir(dynload):  # a layout with the extension modules outside the standard library
            copy_tree(os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload"), dynload)
        loader = None
        for path in loaded_libraries():
            if path.startswith(stdlib):
                continue
            if os.path.basename(path).startswith("ld-"):
                loader = path
            else:
                for name in names_of(path):
                    shutil.copy2(path, os.path.join(staging, "lib", name))
        if loader is None:
            raise SystemExit("no dynamic loader among the mapped libraries: a static python3 needs no copy")
        shutil.copy2(loader, os.path.join(staging, "ld.so"))
        for root, dirs, files in os.walk(staging):  # readable by every sandbox user
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o755)
            for name in files:
                path = os.path.join(root, name)
                os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, CURRENT)
        except OSError:
            if not os.path.isdir(CURRENT):
                raise
    finally:
        if os.path.isdir(staging):
            shutil.rmtree(staging, ignore_errors=True)


main()
