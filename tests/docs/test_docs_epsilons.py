"""Every epsilon the docs print, recomputed from its stated setting by the accountant (and dp-accounting where a
page names it), so that a page cannot drift from the accountant again:

1. every ``flayer ... --dp-plan`` command followed by a ``text`` block is run in process and its output must be
   the block, line for line;
2. the accountant table of docs/results/privacy.md is recomputed cell by cell (exact, PLD, RDP, Poisson, fixed
   size);
3. every other printed figure is listed in :data:`PRINTED` with its setting and recomputed to the digits printed;
4. a scan of the privacy pages finds every "epsilon <decimal>" (and "<decimal> against"): each must be one of the
   figures above, or listed in :data:`NOT_ACCOUNTANT` as what it is (a measured bound, a target).
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from flayer.engine.accountant import epsilon_fixed_size, epsilon_for, noise_for_target

ROOT = Path(__file__).resolve().parents[2]
# every page of the site, the front page and the changelog
PAGES = ["README.md", "CHANGELOG.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]


def _eps(z: float, rounds: int, delta: float = 1e-5) -> float:
    return epsilon_for([(z, 1.0, rounds)], delta)


def _z(target: float, rounds: int = 1) -> float:
    """The noise multiplier the page's benchmark took for a target: the accountant's, to 0.1%."""
    return noise_for_target(target, 1e-5, 1.0, rounds)


def _poisson(z: float, q: float, rounds: int) -> float:
    return epsilon_for([(z, q, rounds)], 1e-5)


def _rdp(z: float, rounds: int) -> float:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds)
    return float(rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(1e-5))


# (page, the text as printed, the figure in it, how it is computed)
PRINTED: list[tuple[str, str, str, Callable[[], float]]] = [
    ("docs/explanation/privacy.md", "epsilon 3.937 at delta 1e-05 after 3 rounds", "3.937",
     lambda: _eps(1.8985, 3)),
    ("docs/howto/privacy-budget.md", "epsilon 3.94 against readers of the models and plans", "3.94",
     lambda: _eps(1.8985, 3)),
    ("docs/explanation/privacy.md", "the printed 8.00 is 19.12 for replace-one", "19.12", lambda: _eps(1.8985 / 2, 10)),
    ("docs/explanation/privacy.md", "the printed 8.00 is 19.12 for replace-one", "8.00", lambda: _eps(1.8985, 10)),
    ("docs/explanation/guarantees.md", "(19.12 where the zero-out figure is 8.00)", "19.12",
     lambda: _eps(1.8985 / 2, 10)),
    ("docs/explanation/privacy.md", "printed epsilon 8.00 where the mechanism\n  spent 18.17", "18.17",
     lambda: _eps(((1.8985 ** -2 - 0.25) + 1.0) ** -0.5, 10)),  # the half-sensitivity rule at count_stddev 1
    ("CHANGELOG.md", "printed epsilon 8.00 where the mechanism spent 18.17", "8.00", lambda: _eps(1.8985, 10)),
    ("CHANGELOG.md", "printed epsilon 8.00 where the mechanism spent 18.17", "18.17",
     lambda: _eps(((1.8985 ** -2 - 0.25) + 1.0) ** -0.5, 10)),
    ("docs/results/privacy-audit.md", "printed 8.00 where the\n  mechanism spent 18.17", "18.17",
     lambda: _eps(((1.8985 ** -2 - 0.25) + 1.0) ** -0.5, 10)),
    ("docs/results/privacy-audit.md", "true one-round epsilon is 4.45", "4.45",
     lambda: _eps(((1.8985 ** -2 - 0.25) + 1.0) ** -0.5, 1)),
    ("docs/results/privacy.md", "the run spent 7.996", "7.996", lambda: _eps(1.0401, 3)),  # schema k = 3, adaptive
    ("docs/howto/privacy-budget.md", "z = 1 spends 159.4 after 200 rounds", "159.4", lambda: _eps(1.0, 200)),
    ("docs/howto/privacy-budget.md", "200 rounds need z >= 15.3", "15.3",
     lambda: noise_for_target(4.0, 1e-5, 1.0, 200)),
    ("docs/howto/privacy-budget.md", "prints 58.73 against the coordinator beside 7.998", "58.73",
     lambda: _eps(1.8985 / 20 ** 0.5, 10)),
    ("docs/results/secure-aggregation.md", "| 9 (diverged) | 16.15 |", "16.15", lambda: _eps(0.86, 9, 1e-3)),
    ("docs/results/secure-aggregation.md", "| 10 (diverged) | 17.40 |", "17.40", lambda: _eps(0.86, 10, 1e-3)),
    ("docs/results/secure-aggregation.md", "| 4 (diverged) | 9.26 |", "9.26", lambda: _eps(0.86, 4, 1e-3)),
    ("docs/results/secure-aggregation.md", "epsilon 16.15 and 17.40 at delta 1e-3", "16.15",
     lambda: _eps(0.86, 9, 1e-3)),
    ("docs/results/secure-aggregation.md", "(epsilon 9.26 spent by then)", "9.26", lambda: _eps(0.86, 4, 1e-3)),
    ("docs/results/privacy.md", "is the accuracy at **epsilon 35.1**", "35.1", lambda: _eps(0.607, 10)),
    # devices' own figures at z 1.8985: two participations (the median), six and seven (the most selected)
    ("docs/results/privacy.md", "the median device has spent 3.12 and the", "3.12", lambda: _eps(1.8985, 2)),
    ("docs/results/privacy.md", "most-selected 5.90 (6 rounds of 10)", "5.90", lambda: _eps(1.8985, 6)),
    ("docs/results/privacy.md", "the most-selected 6.46 (7 rounds)", "6.46", lambda: _eps(1.8985, 7)),
    ("docs/results/privacy.md", "A device in one round of the five spent 3.12", "3.12", lambda: _eps(1.8985, 2)),
    ("docs/results/privacy.md", "rounds, the median device spent 3.12 of the 8.0", "3.12", lambda: _eps(1.8985, 2)),
    ("docs/results/privacy.md", "(25.8, 15.3 and", "25.8", lambda: _eps(0.607, 10, 0.0063)),
    ("docs/results/privacy.md", "(25.8, 15.3 and", "15.3", lambda: _eps(0.856, 10, 0.0063)),
    ("docs/results/privacy.md", "5.1 at their delta 0.0063", "5.1", lambda: _eps(1.855, 10, 0.0063)),
    ("docs/results/privacy.md", "spend 13.0, 7.2 and 2.3 at delta 1e-5", "13.0", lambda: _eps(1.280, 10)),
    ("docs/results/privacy.md", "spend 13.0, 7.2 and 2.3 at delta 1e-5", "7.2", lambda: _eps(2.068, 10)),
    ("docs/results/privacy.md", "spend 13.0, 7.2 and 2.3 at delta 1e-5", "2.3", lambda: _eps(5.527, 10)),
    ("docs/results/privacy.md", "(6.7, 3.3 and 0.74 at 0.037, exact)", "6.7", lambda: _eps(1.280, 10, 0.037)),
    ("docs/results/privacy.md", "(6.7, 3.3 and 0.74 at 0.037, exact)", "3.3", lambda: _eps(2.068, 10, 0.037)),
    ("docs/results/privacy.md", "(6.7, 3.3 and 0.74 at 0.037, exact)", "0.74", lambda: _eps(5.527, 10, 0.037)),
    ("docs/results/privacy.md", "at z = 0.856 at epsilon 21.9", "21.9", lambda: _eps(0.856, 10)),
    ("docs/results/privacy.md", "(now epsilon 8.2)", "8.2", lambda: _eps(1.855, 10)),
    # the audit page: the accountant's figure for one round (many-run audit) and three (one-run estimate)
    ("docs/results/privacy-audit.md", "| 3.732 | 0.999 |", "0.999", lambda: _eps(_z(1.0), 1)),
    ("docs/results/privacy-audit.md", "| 1.082 | 3.996 |", "3.996", lambda: _eps(_z(4.0), 1)),
    ("docs/results/privacy-audit.md", "| 0.601 | 7.994 |", "7.994", lambda: _eps(_z(8.0), 1)),
    ("docs/explanation/privacy.md", "the same z would spend 1.75 against", "1.75", lambda: _poisson(1.8985, 0.2, 10)),
    ("docs/explanation/privacy.md", "and 3.31 against one who", "3.31",
     lambda: epsilon_fixed_size(100, 20, 1.8985, 10, 1e-5)),
    ("docs/results/privacy.md", "4.322 / 1.092 against 3.999", "1.092", lambda: _rdp(11.8047, 10)),
    ("docs/results/privacy.md", "4.322 / 1.092 against 3.999", "4.322", lambda: _rdp(3.42, 10)),
    ("docs/results/privacy.md", "reports 8.597 where this release states 7.998", "8.597", lambda: _rdp(1.8985, 10)),
]

# figures next to "epsilon" on these pages that are not the accountant's: (page, figure) -> what it is
NOT_ACCOUNTANT: dict[tuple[str, str], str] = {
    ("docs/howto/privacy-budget.md", "8.0"): "target_epsilon = 8.0 in a config file: a setting",
    ("docs/results/secure-aggregation.md", "4.4"): "\"at the same epsilon: 4.4 points\": accuracy points",
    ("docs/results/secure-aggregation.md", "0.009"): "\"spends 0.009 s\": CPU seconds",
    ("docs/howto/install.md", "2.25"): "a training loss against another",
    ("docs/results/thin-links.md", "0.96"): "an accuracy against another",
    ("docs/results/thin-links.md", "0.95"): "an accuracy against another",
    ("docs/results/secure-aggregation.md", "0.010"): "\"spends 0.010 s\": CPU seconds",
    **{("docs/results/privacy-audit.md", f): "an audit's measured lower bound or estimate, beside the accountant's"
       for f in ("0.73", "1.56", "1.20", "3.2", "7.3", "0.316", "4.55", "1.48", "2.47", "1.71", "1.86", "2.31", "2.39", "1.93", "2.28",
                 "2.57", "3.56", "7.96", "11.31", "3.94", "10.7")},
    **{("docs/explanation/privacy.md", f): "the banded audit's measured estimate or lower bound, beside the ledger's"
       for f in ("7.96", "11.3")},
}


def _text(page: str) -> str:
    return (ROOT / page).read_text()


def _digits(printed: str) -> int:
    return len(printed.split(".")[1]) if "." in printed else 0


@pytest.mark.parametrize("page, phrase, figure, compute", PRINTED, ids=[f"{p}:{f}" for p, _, f, _ in PRINTED])
def test_each_printed_epsilon_is_the_accountants(page: str, phrase: str, figure: str,
                                                  compute: Callable[[], float]) -> None:
    assert phrase in _text(page), f"{page} no longer prints {phrase!r}: update PRINTED with what it prints now"
    assert figure in phrase
    got = compute()
    assert f"{got:.{_digits(figure)}f}" == figure, f"{page}: prints {figure}, the accountant gives {got:.6g}"


def _dp_plan_examples() -> list[tuple[str, str, list[str]]]:
    """(page, command, expected output lines) for every --dp-plan command followed by a text block."""
    from tests.docs.test_docs_commands import code_blocks, commands

    out = []
    for page in PAGES:
        blocks = code_blocks(_text(page))
        for i, (_, lang, lines) in enumerate(blocks):
            for _, cmd in commands(lines):
                if "--dp-plan" in cmd and i + 1 < len(blocks) and blocks[i + 1][1] == "text":
                    out.append((page, cmd, blocks[i + 1][2]))
    return out


@pytest.mark.parametrize("page, cmd, expected", _dp_plan_examples(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_dp_plan_output_on_the_pages_is_what_the_command_prints(page: str, cmd: str,
                                                                      expected: list[str]) -> None:
    from cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(shlex.split(cmd)[1:]) == 0
    assert buf.getvalue().strip().splitlines() == [line for line in expected if line.strip()], \
        f"{page}: the output printed after `{cmd}` is not what the command prints now"


@pytest.mark.slow  # dp-accounting's PLD for nine settings: about 25 s
def test_the_privacy_results_accountant_table_recomputes() -> None:
    """docs/results/privacy.md's table of one setting's epsilon by accountant: each cell from dp-accounting 0.6 or
    the exact composition, at the table's 10 rounds, population 100 and 20 a round."""
    dpa = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    from flayer.engine.accountant import epsilon_fixed_size

    rows = [line for line in _text("docs/results/privacy.md").splitlines()
            if re.match(r"^\| [0-9.]+ \| .* \| (1e-05|0\.0063) \| \*\*", line)]
    assert len(rows) >= 6, "the accountant table of docs/results/privacy.md was not found"
    for row in rows:
        cells = [c.strip().strip("*") for c in row.strip("|").split("|")]
        z, delta = float(cells[0]), float(cells[2])
        event = dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z), 10)
        poisson = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.2, dpa.GaussianDpEvent(z)), 10)
        want = [_eps(z, 10, delta), pld_privacy_accountant.PLDAccountant().compose(event).get_epsilon(delta),
                rdp_privacy_accountant.RdpAccountant().compose(event).get_epsilon(delta),
                pld_privacy_accountant.PLDAccountant().compose(poisson).get_epsilon(delta),
                epsilon_fixed_size(100, 20, z, 10, delta)]
        for cell, value in zip(cells[3:8], want):
            assert cell == f"{value:.3f}", f"docs/results/privacy.md, z {z}: prints {cell}, recomputed {value:.4f}"


FIGURE = re.compile(r"epsilons?\W{0,3}(?:of\W+|is\W+|at\W+)?\**(\d+\.\d+)|(\d+\.\d+)\**\s+against"
                    r"|(?:spent|spends?)\s+(\d+\.\d+)")


def test_every_decimal_epsilon_on_the_privacy_pages_is_accounted_for() -> None:
    """The scan: a figure printed beside "epsilon" that no check above recomputes fails here."""
    known = {(p, f) for p, _, f, _ in PRINTED} | set(NOT_ACCOUNTANT)
    table = {(p, f) for p, cmd, lines in _dp_plan_examples() for f in re.findall(r"\d+\.\d+", " ".join(lines))}
    missing = []
    for page in PAGES:
        for m in FIGURE.finditer(_text(page)):
            figure = m.group(1) or m.group(2) or m.group(3)
            if (page, figure) not in known and (page, figure) not in table:
                line = _text(page)[:m.start()].count("\n") + 1
                missing.append(f"{page}:{line}: {m.group(0)!r}")
    assert not missing, ("epsilon figures no test recomputes (add each to PRINTED with its setting, or to "
                         "NOT_ACCOUNTANT saying what it is):\n" + "\n".join(missing))
