"""The module paths of the old flat layout still import, for one release: the same module objects, with a
``DeprecationWarning`` naming the new path (``pergrad/_moved.py``); so do the feature errors that lived in
``pergrad.errors``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pergrad
from pergrad import _moved, errors

ROOT = Path(__file__).resolve().parents[1]


def test_every_old_path_imports_the_moved_module_with_a_warning() -> None:
    # a fresh process: in this one, earlier tests may have imported the old names already
    script = textwrap.dedent(
        """
        import importlib, warnings
        from pergrad import _moved
        checked = 0
        for old, new in _moved.MOVED.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    module = importlib.import_module(f"pergrad.{old}")
                except ImportError as e:  # an integration without its extra (pergrad.hf needs transformers)
                    assert "pip install 'pergrad[" in str(e) or not (e.name or "pergrad").startswith("pergrad"), e
                    continue
            checked += 1
            assert module is importlib.import_module(f"pergrad.{new}"), old
            said = [str(w.message) for w in caught if w.category is DeprecationWarning]
            assert said and said[0].startswith(f"pergrad.{old} moved to pergrad.{new};"), (old, said)
        from pergrad.projectors import kron_ranks  # the documented spellings of 0.1
        from pergrad.lm_loss import per_sample_lm_loss
        print("ok", checked)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == "ok" and int(done.stdout.split()[1]) >= len(_moved.MOVED) - 2


def test_the_new_paths_import_without_a_warning() -> None:
    script = (
        "import importlib, pergrad._moved as m\n"
        "for n in m.MOVED.values():\n"
        "    try:\n"
        "        importlib.import_module('pergrad.' + n)\n"
        "    except ImportError as e:  # an integration without its extra (pergrad.integrations.hf: transformers)\n"
        "        assert \"pip install 'pergrad[\" in str(e) or not (e.name or 'pergrad').startswith('pergrad'), e"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", script], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_an_old_name_on_the_package_warns_and_a_wrong_one_raises() -> None:
    with pytest.warns(DeprecationWarning, match=r"pergrad\.audit moved to pergrad\.privacy\.audit"):
        assert pergrad.__getattr__("audit") is pergrad.privacy.audit
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        pergrad.__getattr__("nope")


@pytest.mark.parametrize("name", sorted(errors.MOVED))
def test_a_moved_error_keeps_its_old_path_with_a_warning(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"pergrad\.errors\.{name} moved to {errors.MOVED[name]}\.{name}"):
        moved = getattr(errors, name)
    assert issubclass(moved, errors.PergradError)
    assert getattr(pergrad, name, moved) is moved  # the package exports it under the same class
