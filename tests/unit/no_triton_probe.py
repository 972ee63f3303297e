"""Run in a subprocess by test_without_triton.py: hides triton from imports (a meta-path
blocker, installed before anything else), then imports every quantdispatch module, runs the
CLI commands given as JSON argv lists, calls ``quantdispatch.select``, and prints one JSON
object with what happened. Never imported by pytest itself."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import pkgutil
import sys
import traceback


class _HideTriton:
    """A meta-path finder that makes ``import triton`` fail as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _import_all() -> dict[str, str]:
    import quantdispatch

    failed = {}
    for info in pkgutil.walk_packages(quantdispatch.__path__, "quantdispatch."):
        if info.name.endswith("__main__"):  # runs the CLI when imported
            continue
        try:
            importlib.import_module(info.name)
        except Exception as exc:
            failed[info.name] = f"{type(exc).__name__}: {exc}"
    return failed


def _run(argv: list[str]) -> dict:
    from quantdispatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            code = "raised"
            err.write(traceback.format_exc())
    return {"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue()}


def main() -> None:
    sys.meta_path.insert(0, _HideTriton())
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        del sys.modules[name]
    failed = _import_all()
    runs = [_run(argv) for argv in json.loads(sys.argv[1])]
    import quantdispatch

    explain = quantdispatch.select("nvfp4").explain()
    print(json.dumps({"failed_imports": failed, "runs": runs, "select": explain}))


if __name__ == "__main__":
    main()
