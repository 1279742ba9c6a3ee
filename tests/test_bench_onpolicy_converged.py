"""bench/quality_onpolicy_converged.py's pure parts: the text rows it cuts from documents, and its verdicts (the
rule docs/on-policy.md's converged section states): a row beats continued off-policy KD on a measure only when it
is lower on every seed and the mean paired difference exceeds its standard deviation; the held-out KL is named
within, lower or higher beyond the two rows' spread."""

from __future__ import annotations

from bench.quality_onpolicy_converged import ROWS, text_rows, verdicts

OFF, ON = ROWS[0][0], ROWS[1][0]


def test_text_rows_cut_prefix_and_completion_at_line_ends_and_mark_the_prompt():
    doc = "".join(f"line {i:03d} " + "x" * 30 + "\n" for i in range(40))  # 40 lines of 40 characters
    rows = text_rows([doc], prefix=100, completion=80)
    assert len(rows) == 3  # at characters 0, 400 and 800
    for r, start in zip(rows, (0, 400, 800)):
        prefix, completion = r["text"][:r["prefix_chars"]], r["text"][r["prefix_chars"]:]
        assert doc[start:].startswith(r["text"]) and prefix.endswith("\n") and completion.endswith("\n")
        assert len(prefix) >= 100 and len(completion) >= 80  # whole lines past each bound
    assert text_rows(["short\n"], prefix=100, completion=80) == []  # too short for either part: skipped


def _runs(rev, nll, kl, tok=0.5, length=40.0):
    return [{"seed": s, "reverse_kl_per_sequence": rev[s], "teacher_nll_per_byte": nll[s], "heldout_kl": kl[s],
             "reverse_kl_per_token": tok, "mean_student_tokens": length} for s in range(3)]


def test_a_row_beats_on_a_measure_only_when_lower_on_every_seed_beyond_the_paired_spread():
    rows = {"converged student": [], OFF: _runs([20, 22, 24], [1.10, 1.12, 1.14], [2.08, 2.09, 2.10]),
            ON: _runs([15, 16, 18], [1.11, 1.10, 1.15], [2.09, 2.10, 2.11])}
    (line,) = verdicts(rows)
    assert "reverse KL/sequence -5.667" in line and "lower on 3/3 seeds" in line
    assert "teacher NLL/byte" in line and "lower on 1/3 seeds" in line  # mixed: not beaten
    assert "**beats it on reverse KL/sequence, held-out KL within the spread**" in line
    rows[ON] = _runs([19, 23, 23], [1.00, 1.02, 1.04], [1.90, 1.91, 1.92])  # one seed higher on reverse KL
    (line,) = verdicts(rows)
    assert "**beats it on teacher NLL/byte, held-out KL lower beyond the spread**" in line
    rows[ON] = _runs([30, 31, 32], [1.2, 1.2, 1.2], [2.30, 2.31, 2.32])
    (line,) = verdicts(rows)
    assert "**beats it on neither, held-out KL higher beyond the spread**" in line
