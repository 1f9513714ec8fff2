"""zoo.core.progress: where zoo's own lines and a dependency's go while a run writes its log."""

from __future__ import annotations

import logging

import pytest

from zoo.core.progress import held_back, run_log


def printer(module_name: str):
    """A function whose frame belongs to module ``module_name``: what a print() from that module looks like."""
    namespace = {"__name__": module_name}
    exec("def show(text):\n    print(text)\n", namespace)
    return namespace["show"]


def test_zoos_prints_reach_the_terminal_and_a_dependencys_go_to_the_log(tmp_path, capsys):
    zoo_table, library = printer("zoo.export.stages"), printer("lerobot.policies.pretrained")
    with run_log(tmp_path / "run.log"):
        zoo_table("chunk  rel L2")
        library("Loading weights from local directory")
    out = capsys.readouterr().out
    log = (tmp_path / "run.log").read_text()
    assert "chunk  rel L2" in out and "Loading weights" not in out
    assert "Loading weights from local directory" in log
    library("after the run")  # the run is over: a library prints to the terminal again
    assert "after the run" in capsys.readouterr().out


def test_output_from_before_the_log_existed_is_written_into_it(tmp_path, capsys):
    logger = logging.getLogger("zoofix.library")
    with held_back():
        # A library configuring its logger on import, while the stand-in is sys.stderr, and logging at once.
        logger.addHandler(logging.StreamHandler())
        logger.warning("loaded before the log")
    try:
        with run_log(tmp_path / "run.log"):
            logger.warning("logged during the run")
        log = (tmp_path / "run.log").read_text()
        assert "loaded before the log" in log and "logged during the run" in log
        assert "before the log" not in capsys.readouterr().err
    finally:
        logger.handlers.clear()


def test_a_failure_before_the_log_existed_shows_what_was_held_back(capsys):
    import sys

    with pytest.raises(RuntimeError):
        with held_back():
            print("the library's last words", file=sys.stderr)
            raise RuntimeError("import failed")
    assert "the library's last words" in capsys.readouterr().err
