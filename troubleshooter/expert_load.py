"""Router collapse read from what a log prints about expert load.

Users print the tokens each expert received (``tokens_per_expert``, native MoE's ``exp_counts``,
an "expert load" list or a per-expert table, plain or in a rich box) or the router's top-k expert
indices (``topk_idx``, ``selected_experts``). A healthy router spreads tokens; a collapsed one
sends most of them to one expert, or leaves many experts with none. :func:`find_collapse` parses
every such printout in a log and returns the last one that shows a collapse, or None: a balanced
printout is not a problem, so the mere keyword never is.

Thresholds (the field notes' "one expert takes more than half of the tokens"): with 4 or more
experts, one expert's share above 50 %, or at least half of the experts below a tenth of an even
share (dead experts); with 2 or 3 experts, one share above 90 %. For a top-k index table, the
share of rows (tokens) that route to one expert: above 90 % for k >= 2, above 50 % for k = 1 (a
flat list of at least 8 ids is read as one top-1 id per token).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Collapse", "LOAD_KEY", "INDEX_KEY", "find_collapse"]

#: A printout of per-expert load (not a load-balancing loss).
LOAD_KEY = re.compile(
    r"(?:tokens?[_ ]per[_ ]expert|\bexp(?:ert)?_counts?\b|expert[_ ](?:load|counts?|usage|utili[sz]ation"
    r"|distribution|histogram|frequenc(?:y|ies)|assignments?)(?![_ ]?(?:balanc|loss|coef))"
    r"|load[_ ]per[_ ]expert|router[_ ]load|per[- ]expert (?:tokens|load|counts?))", re.IGNORECASE)
#: A printout of the router's chosen expert ids per token.
INDEX_KEY = re.compile(
    r"(?:top_?k_?(?:idx|indices|index|ids|experts)|selected_experts|expert_(?:idx|indices|ids)"
    r"|router_indices|routing_indices|top-k (?:expert )?ind(?:ex|ices))", re.IGNORECASE)
_NUM = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_ROW_SPLIT = re.compile(r"[│┃|]")
_BORDER = re.compile(r"^[\s┏┓┗┛┡┩┣┫┳┻╇╋━─┃│╭╮╰╯├┤┬┴┼═╞╡╪+|=-]*$")
_PREFIX = re.compile(r"^\s*(?:\[rank\d+\]:|\d+:|\[[^\]\n]{0,60}\])?\s*")
MAX_BLOCK = 20_000
#: A per-expert table must start within this many lines of its keyword (a title, a header row).
TABLE_START = 6


@dataclass(frozen=True)
class Collapse:
    """A printout that shows a collapsed router."""

    offset: int  # where the printout starts in the text
    summary: str  # one sentence: what the numbers show


_OPENING = re.compile(r"[\[{]\s*(?=[\[{\d.+-])")


def _line_end(text: str, start: int, lines: int = 1) -> int:
    """The end of the ``lines``-th line from ``start`` (1: the line ``start`` is on)."""
    end = start - 1
    for _ in range(lines):
        end = text.find("\n", end + 1)
        if end == -1:
            return len(text)
    return end


def _bracketed(text: str, start: int) -> str | None:
    """The balanced [...] (or {...}) of numbers that opens first after ``start``, on its line or
    the next one (``topk_idx:`` then ``tensor([[...``); a slice such as ``[:10]`` is skipped."""
    opening = _OPENING.search(text, start, _line_end(text, start, 2))
    if opening is None:
        return None
    open_at = opening.start()
    depth = 0
    for i in range(open_at, min(len(text), open_at + MAX_BLOCK)):
        depth += text[i] in "[{"
        depth -= text[i] in "]}"
        if depth == 0:
            return text[open_at:i + 1]
    return None


def _rows(block: str) -> list[list[float]]:
    """The innermost [...] groups of a bracketed block as rows of numbers ({k: v}: the values)."""
    if block.startswith("{"):
        return [[float(v) for v in re.findall(r":\s*(" + _NUM.pattern + ")", block)]]
    inner = re.findall(r"\[([^\[\]]*)\]", block)
    return [[float(x) for x in _NUM.findall(row)] for row in inner if _NUM.search(row)]


def _table_after(text: str, start: int) -> tuple[list[float], int]:
    """Counts from per-expert table rows right under the line at ``start`` ("expert 0: 3712",
    "│ 0 │ 3712 │ 90.6% │"): rows whose first number is the expert id (0 or 1, 2, ... in order),
    then its count (and maybe a share); the table starts within a few lines (its title, header).
    Returns the counts and the first row's expert id."""
    line_end = text.find("\n", start)
    if line_end == -1:
        return [], 0
    counts: list[float] = []
    first_id = 0
    for index, line in enumerate(text[line_end + 1:line_end + 1 + MAX_BLOCK].splitlines()[:300]):
        body = _PREFIX.sub("", line, count=1)
        if not counts and index > TABLE_START:
            break
        if not body.strip() or _BORDER.match(body):
            if counts and not body.strip():
                break
            continue
        cells = [c for c in _ROW_SPLIT.split(body) if c.strip()] if _ROW_SPLIT.search(body) else [body]
        numbers = [n for c in cells for n in _NUM.findall(c.replace("%", " "))]
        row = re.match(r"\W*(?:expert\s*)?#?(\d+)\b", cells[0].strip(), re.IGNORECASE)
        expert = int(row.group(1)) if row else -1
        if 2 <= len(numbers) <= 4 and (expert in (0, 1) if not counts else expert == first_id + len(counts)):
            first_id = expert if not counts else first_id
            counts.append(float(numbers[1]))
        elif counts:
            break
    return counts, first_id


def _load_verdict(loads: list[float], first_id: int = 0) -> str | None:
    experts = len(loads)
    total = sum(loads)
    if experts < 2 or total <= 0 or min(loads) < 0:
        return None
    shares = [v / total for v in loads]
    top = max(range(experts), key=shares.__getitem__)
    dead = sum(s < 0.1 / experts for s in shares)
    if shares[top] > (0.5 if experts >= 4 else 0.9):
        return (f"expert {top + first_id} gets {shares[top]:.0%} of the tokens over {experts} experts "
                f"(an even share is {1 / experts:.0%})" + (f"; {dead} get almost none" if dead else "") + ".")
    if experts >= 4 and dead >= experts / 2:
        return f"{dead} of {experts} experts get almost no tokens (dead experts)."
    return None


def _index_verdict(rows: list[list[float]]) -> str | None:
    if len(rows) == 1 and len(rows[0]) >= 8:  # a flat list: one top-1 expert id per token
        rows = [[v] for v in rows[0]]
    rows = [r for r in rows if r and all(v >= 0 and float(v).is_integer() for v in r)]
    if len(rows) < 8:
        return None
    k = max(len(r) for r in rows)
    seen = {int(v) for r in rows for v in r}
    hits = {e: sum(e in {int(v) for v in r} for r in rows) for e in seen}
    top = max(hits, key=hits.__getitem__)
    share = hits[top] / len(rows)
    if (k >= 2 and share >= 0.9) or (k == 1 and share > 0.5 and max(seen) >= 2):
        experts = max(seen) + 1  # at least this many
        return (f"expert {top} is among the top-{k} choices of {share:.0%} of {len(rows)} tokens (with "
                f"{experts} or more experts, an even router picks each for at most {min(1.0, k / experts):.0%}).")
    return None


def _same_line(text: str, start: int) -> list[float]:
    """Numbers printed on the keyword's own line without brackets ("expert load: 3712 61 88"),
    after its last ':' or '='."""
    rest = text[start:_line_end(text, start)]
    cut = max(rest.rfind(":"), rest.rfind("="))
    if cut == -1:  # a title such as "Expert load, layer 3 (step 120)": its numbers are no loads
        return []
    return [float(n) for n in _NUM.findall(rest[cut + 1:].replace("%", " "))]


def _verdicts(text: str):
    for hit in LOAD_KEY.finditer(text):
        block = _bracketed(text, hit.end())
        same_line = _same_line(text, hit.end()) if block is None else []
        if block:
            rows, first_id = _rows(block), 0
        elif len(same_line) >= 2:
            rows, first_id = [same_line], 0
        else:
            table, first_id = _table_after(text, hit.end())
            rows = [table]
        for row in rows:
            if (verdict := _load_verdict(row, first_id)) is not None:
                yield hit.start(), verdict
                break
    for hit in INDEX_KEY.finditer(text):
        block = _bracketed(text, hit.end())
        if block and (verdict := _index_verdict(_rows(block))) is not None:
            yield hit.start(), verdict


def find_collapse(text: str) -> Collapse | None:
    """The last expert-load or top-k printout in ``text`` that shows a collapsed router."""
    found = sorted(_verdicts(text))
    return Collapse(*found[-1]) if found else None
