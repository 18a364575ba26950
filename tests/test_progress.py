import io
import re

from curvlab.util.progress import LineProgress, progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_bar_anything_else_plain_lines(monkeypatch):
    tty = Terminal()
    for _ in progress(range(5), desc="work", stream=tty):
        pass
    assert "\r" in tty.getvalue() and "5/5" in tty.getvalue()  # tqdm's bar, redrawn in place

    monkeypatch.setenv("CURVLAB_PROGRESS_INTERVAL", "1e9")
    log = io.StringIO()
    bar = progress(range(500), desc="work", stream=log)
    assert isinstance(bar, LineProgress)
    for i in bar:
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
    assert re.fullmatch(r"work: 500/500 \(100%\), \d+ s, loss=0\.002\n", log.getvalue())  # one line, at the end

    monkeypatch.setenv("CURVLAB_PROGRESS_INTERVAL", "0")
    log = io.StringIO()
    for _ in progress(iter(range(3)), desc="work", stream=log):
        pass
    lines = log.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["work: 1", "work: 2", "work: 3", "work: 3"]

    quiet = io.StringIO()
    for _ in progress(range(3), desc="work", disable=True, stream=quiet):
        pass
    assert quiet.getvalue() == ""


def test_an_update_driven_bar_redraws_at_the_line_interval_off_a_terminal(monkeypatch):
    from curvlab.util.progress import refresh_interval

    monkeypatch.setenv("CURVLAB_PROGRESS_INTERVAL", "7")
    assert refresh_interval(Terminal()) == 0.1 and refresh_interval(io.StringIO()) == 7.0
    monkeypatch.delenv("CURVLAB_PROGRESS_INTERVAL")
    assert refresh_interval(io.StringIO()) == 30.0
