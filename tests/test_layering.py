"""The import graph of docs/design.md, checked on the source (no imports are run).

training program -> adapter (store.py, integration.py) -> stage machine (worker/) and local
rules (glu/) -> worker client (kvstore/client.py) -> protocol; server and scheduler ->
protocol. Nothing below imports from above, and only the client and the nodes speak the
protocol. settings.py (the one settings table) and fields.py (the checks of a peer's
values) are leaves every layer may read; so is timeline.py, the process's recorder of
spans, which the worker, the transport and the nodes call (its merge is not)."""
from pathlib import Path

import pytest

from test_packaging import _imports as _absolute_imports

PKG = Path(__file__).resolve().parents[1] / "ssdsgd"


def _imports(path):
    """The ssdsgd modules and packages ``path`` imports, relative to the package."""
    names = (n.removeprefix("ssdsgd.") for n in _absolute_imports(path)
             if n.startswith("ssdsgd."))
    return {n for n in names if (PKG / (n.replace(".", "/") + ".py")).exists()
            or (PKG / n.replace(".", "/")).is_dir()}


def _module(path):
    return ".".join(path.relative_to(PKG).with_suffix("").parts)


def _graph(folder):
    return {_module(p): _imports(p) for p in (PKG / folder).glob("*.py")}


def test_the_settings_table_is_a_leaf():
    """It reads only the registry of algorithms (which combinations it refuses)."""
    assert _imports(PKG / "settings.py") == {"sync.registry"}


def test_the_registry_of_algorithms_is_a_leaf():
    """Pure data: the settings table, below everything, asks it."""
    assert _imports(PKG / "sync" / "registry.py") == set()


def test_the_checks_of_a_peers_values_are_a_leaf():
    assert _imports(PKG / "fields.py") == set()


def test_the_timeline_recorder_is_a_leaf():
    assert _imports(PKG / "timeline.py") == set()
    assert _imports(PKG / "timeline_merge.py") == {"timeline"}


LEAVES = {"timeline"}     # may be imported from any layer


def test_the_mxnet_helpers_are_a_leaf():
    for module, deps in _graph("mxglue").items():
        assert all(d.startswith(("mxglue", "settings")) for d in deps), (module, deps)


def test_the_policies_know_no_transport():
    for module, deps in _graph("sync").items():
        assert all(d.startswith(("sync", "mxglue", "settings", "fields")) for d in deps), \
            (module, deps)


def test_the_transport_imports_nothing_from_above():
    for module, deps in _graph("kvstore").items():
        assert all(d in LEAVES or d.startswith(("kvstore", "mxglue", "settings", "fields"))
                   for d in deps), (module, deps)
    graph = _graph("kvstore")
    assert "kvstore.server" not in graph["kvstore.client"]
    for node in ("kvstore.server", "kvstore.scheduler"):
        assert "kvstore.client" not in graph[node], node


def test_the_stage_machine_and_the_local_rules_stay_below_the_adapter():
    for folder, allowed in (("worker", ("worker", "glu", "kvstore", "mxglue", "sync",
                                        "settings")),
                            ("glu", ("glu", "kvstore", "mxglue", "sync", "settings"))):
        for module, deps in _graph(folder).items():
            assert all(d in LEAVES or d.startswith(allowed) for d in deps), (module, deps)
    assert "kvstore.protocol" not in _graph("worker")["worker.machine"], \
        "the stage machine must use the client's API, not build messages"


def test_the_adapter_holds_no_wire_details():
    deps = _imports(PKG / "store.py")
    assert "kvstore.protocol" not in deps and "kvstore.sharding" not in deps, deps
    assert not any(d.startswith("train") or d.startswith("launch") for d in deps), deps


def _run(code):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PKG.parent, timeout=120)


CHECK_FIRST = ("from mxnet import gluon, kvstore; import ssdsgd.integration as i; "
               "assert 'ssd_sync' in kvstore.KVStoreBase.kv_registry; "
               "assert gluon.trainer._create_kvstore is i._create_kvstore; "
               "assert ssdsgd.SSD_Sync.__name__ == 'SSD_Sync'; print('ok')")
ORDERS = ("import ssdsgd; import mxnet", "import mxnet; import ssdsgd",
          "import ssdsgd; from mxnet import gluon")
CHECK_ANY = ("import mxnet, ssdsgd; from mxnet import gluon, kvstore; "
             "import ssdsgd.integration as i; "
             "assert 'ssd_sync' in kvstore.KVStoreBase.kv_registry; "
             "assert gluon.trainer._create_kvstore is i._create_kvstore; print('ok')")
MODULES = ["ssdsgd.glu", "ssdsgd.glu.rules", "ssdsgd.glu.simulate",
           "ssdsgd.mxglue.optimizer_spec", "ssdsgd.store", "ssdsgd.integration",
           "ssdsgd.worker.machine"]


@pytest.fixture(scope="module")
def imports_run():
    """code -> (returncode, stdout, stderr) of every fresh interpreter the registration
    tests below need, all started at once: each spends seconds importing MXNet, and
    waiting for them one after another cost ~40 s of the suite."""
    import subprocess
    import sys
    codes = [f"{first}; {CHECK_FIRST}" for first in ORDERS] + \
        [f"import {module}; {CHECK_ANY}" for module in MODULES]
    procs = {code: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=PKG.parent)
             for code in codes}
    results = {}
    try:
        for code, proc in procs.items():
            out, err = proc.communicate(timeout=180)
            results[code] = (proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_the_launcher_and_the_scheduler_start_without_mxnet():
    """They need none of it, and importing it costs 1-2 s of CPU per process per job."""
    p = _run("import sys, ssdsgd.launch.cli, ssdsgd.node, ssdsgd.kvstore.scheduler; "
             "print('mxnet' in sys.modules)")
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr[-2000:]


# The tests of ``imports_run`` share one xdist worker: pytest-xdist runs a module's fixture
# once per worker, and split between two the 10 interpreters ran twice (28 s and 21 s).
IMPORTS_GROUP = pytest.mark.xdist_group("layering_imports")


@IMPORTS_GROUP
def test_import_ssdsgd_registers_ssd_sync_before_or_after_mxnet(imports_run):
    """``import ssdsgd`` keeps its promise whichever comes first: MXNet already imported
    (installed at once), or imported later (installed right after it, by the hook)."""
    for first in ORDERS:
        _, stdout, stderr = imports_run[f"{first}; {CHECK_FIRST}"]
        assert stdout.strip() == "ok", (first, stderr[-2000:])


@IMPORTS_GROUP
@pytest.mark.parametrize("module", MODULES)
def test_any_module_imported_first_still_registers_ssd_sync(imports_run, module):
    """A module that imports MXNet itself, imported before anything else, used to run the
    install in the middle of its own import (the hook fires inside it), and the install's
    imports found it half made: ImportError. The install now waits for it to finish."""
    _, stdout, stderr = imports_run[f"import {module}; {CHECK_ANY}"]
    assert stdout.strip() == "ok", (module, stderr[-2000:])
