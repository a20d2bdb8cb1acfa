"""``plora.log`` (:mod:`plora.sweepdir.logfile`): plora's console shows plora's warnings only,
the log file gets every record from INFO, those logged before the sweep directory existed too."""

from __future__ import annotations

import logging
import warnings

from plora.sweepdir.logfile import sweep_log


def test_console_shows_plora_and_the_file_everything(tmp_path, capfd) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with sweep_log() as log:
        logging.getLogger("plora.runtime.driver").info("data: train 3 rows cut")
        logging.getLogger("plora.runtime.driver").warning("note: a stale lock was taken over")
        logging.getLogger("some.library").warning("a library's warning")
        warnings.warn("a deprecated argument", FutureWarning, stacklevel=1)
        assert not (tmp_path / "plora.log").exists()  # no directory yet: kept in memory
        log.attach(tmp_path)
        logging.getLogger("some.library.loader").info("loading weights")
        logging.getLogger("plora.engine.session").debug("below INFO: nowhere")
    err = capfd.readouterr().err
    assert err.splitlines() == ["note: a stale lock was taken over"]
    text = (tmp_path / "plora.log").read_text()
    for part in ("INFO plora.runtime.driver: data: train 3 rows cut",
                 "WARNING plora.runtime.driver: note: a stale lock was taken over",
                 "WARNING some.library: a library's warning",
                 "WARNING py.warnings:", "a deprecated argument",
                 "INFO some.library.loader: loading weights"):  # fmt: skip
        assert part in text, (part, text)
    assert "below INFO" not in text
    lines = text.splitlines()
    assert lines.index(next(x for x in lines if "data: train" in x)) == 0  # early records first
    # restored: the handlers and level as before, warnings no longer captured
    assert root.handlers == handlers and root.level == level
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("after", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["after"]


def test_a_sweep_that_fails_before_its_directory_writes_no_log(tmp_path) -> None:
    try:
        with sweep_log():
            logging.getLogger("plora.runtime.driver").info("set-up")
            raise RuntimeError("the first plan failed")
    except RuntimeError:
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_resumed_sweep_appends(tmp_path) -> None:
    for n in (1, 2):
        with sweep_log() as log:
            log.attach(tmp_path)
            logging.getLogger("plora.runtime.driver").info("run %d", n)
    text = (tmp_path / "plora.log").read_text()
    assert "run 1" in text and "run 2" in text and text.index("run 1") < text.index("run 2")
