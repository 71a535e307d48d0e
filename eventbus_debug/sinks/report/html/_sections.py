"""The page's cards, tables and sections: incidents and the recovery chain (each row linked to
the rows it caused or came from), the runs of a log, the ranks of a merged one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ..summary import IncidentRow, RunInfo, RunSummary, Stat
from ._format import _anchor, _e, _int, _num, _pct, _slug, _time


def _overhead_card(s: RunSummary) -> list[str]:
    """The debugger's measured cost per step, beside its budget (no card when unmeasured)."""
    if s.overhead is None:
        return []
    over = s.overhead_budget is not None and s.overhead > s.overhead_budget
    label = "debugger overhead" + (
        f" (budget {_pct(s.overhead_budget)})" if s.overhead_budget is not None else ""
    )
    return [_card(label, _pct(s.overhead), "warn" if over else "ok", card_id="overhead")]


def _card(label: str, value: str, cls: str = "", card_id: str = "") -> str:
    ident = f' id="{_slug(card_id)}"' if card_id else ""
    return (
        f'<div class="card {_slug(cls)}"{ident}><div class="v">{_e(value)}</div>'
        f'<div class="l">{_e(label)}</div></div>'
    )


def _kv_table(table_id: str, header: tuple[str, str], rows: Iterable[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td>{_e(k)}</td><td class='num'>{_e(v)}</td></tr>" for k, v in rows)
    if not body:
        body = "<tr><td colspan='2' class='note'>none</td></tr>"
    return (
        f'<table id="{_slug(table_id)}"><thead><tr><th>{_e(header[0])}</th><th>{_e(header[1])}</th>'
        f"</tr></thead><tbody>{body}</tbody></table>"
    )


def _counts(mapping: Mapping[str, int]) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in sorted(mapping.items(), key=lambda kv: (-kv[1], str(kv[0])))]


def _stat_row(name: str, stat: Stat, unit: str = " %") -> str:
    if not stat.samples:
        return f"<tr><td>{_e(name)}</td><td colspan='3' class='note'>not sampled</td></tr>"
    return (
        f"<tr><td>{_e(name)}</td><td class='num'>{_num(stat.mean, 3)}{unit}</td>"
        f"<td class='num'>{_num(stat.min, 3)}{unit}</td><td class='num'>{_num(stat.max, 3)}{unit}</td></tr>"
    )


def _ref(rank: int, seq: int, rows: Mapping[tuple[int, int], IncidentRow]) -> str:
    """A link to the row of event *seq* on *rank* (plain text when that row left the table)."""
    row = rows.get((rank, seq))
    what = f" {_e(row.kind)}" if row is not None else ""
    if row is None:
        return f"<span class='note'>#{_int(seq)} (no longer listed)</span>"
    return f"<a class='link' href='#{_anchor(rank, seq)}'>#{_int(seq)}{what}</a>"


def _ranks(row: IncidentRow) -> str:
    """The ranks that had the incident of *row*, e.g. ``0, 1``."""
    ranks = row.ranks if isinstance(row.ranks, tuple) and row.ranks else (row.rank,)
    return ", ".join(_int(k) for k in ranks)


def _rank_header(rows: Sequence[IncidentRow]) -> str:
    return "ranks" if any(len(r.ranks) > 1 for r in rows) else "rank"


def _incident_table(rows: Sequence[IncidentRow], total: int, first: int) -> str:
    """Newest first; when incidents were left out, a row says how many, between the most
    recent and the run's *first* ones."""
    by_key = {(r.rank, r.seq): r for r in rows}
    body = []
    left_out = total - len(rows)
    for i, r in zip(range(len(rows) - 1, -1, -1), reversed(rows), strict=True):
        if i == first - 1 and left_out > 0:
            body.append(
                f"<tr class='gap'><td colspan='9' class='note'>{_int(left_out)} incidents "
                "not listed; the run's first ones below</td></tr>"
            )
        caused = "" if r.caused_by is None else _ref(r.rank, r.caused_by, by_key)
        led = " ".join(_ref(r.rank, seq, by_key) for seq in r.led_to)
        body.append(
            f"<tr id='{_anchor(r.rank, r.seq)}'>"
            f"<td class='num'>{_int(r.step)}</td>"
            f"<td class='num'>{_ranks(r)}</td><td class='sev-{_slug(r.severity)}'>{_e(r.severity)}</td>"
            f"<td>{_e(r.kind)}</td><td>{_e(r.message)}</td><td>{_e(r.source)}</td>"
            f"<td class='caused-by'>{caused}</td><td class='led-to'>{led}</td>"
            f"<td class='num'>{_int(r.seq)}</td></tr>"
        )
    if not body:
        body.append("<tr><td colspan='9' class='note'>no incident: a quiet run</td></tr>")
    note = ""
    if left_out > 0:
        shown = f"the {_int(len(rows) - first)} most recent"
        if first:
            shown = f"the first {_int(first)} and {shown}"
        note = f"<p class='note'>showing {shown} of {_int(total)} incidents</p>"
    return (
        f"{note}<table id='incidents'><thead><tr><th>step</th><th>{_rank_header(rows)}</th><th>severity</th>"
        "<th>kind</th><th>what happened</th><th>source</th><th>caused by</th><th>led to</th>"
        f"<th>seq</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def _recovery_chain(rows: Sequence[IncidentRow]) -> str:
    """One row per recovery decision: the incident that triggered it, the decision, and the
    action applied for it, each linked to its row of the incident table."""
    by_key = {(r.rank, r.seq): r for r in rows}
    body = []
    for r in rows:
        if r.kind != "recovery_decided":
            continue
        trigger = (
            "<span class='note'>–</span>"
            if r.caused_by is None
            else _ref(r.rank, r.caused_by, by_key)
        )
        applied = [by_key.get((r.rank, seq)) for seq in r.led_to]
        done = (
            " ".join(
                f"{_ref(a.rank, a.seq, by_key)}: {_e(a.message)}" for a in applied if a is not None
            )
            or "<span class='note'>not applied (yet)</span>"
        )
        body.append(
            f"<tr><td class='num'>{_int(r.step)}</td><td class='num'>{_ranks(r)}</td>"
            f"<td class='trigger'>{trigger}</td>"
            f"<td class='decision'><a class='link' href='#{_anchor(r.rank, r.seq)}'>#{_int(r.seq)}</a> "
            f"{_e(r.message)}</td><td class='applied'>{done}</td></tr>"
        )
    if not body:
        body.append("<tr><td colspan='5' class='note'>no recovery decision</td></tr>")
    return (
        f"<table id='recovery-chain'><thead><tr><th>step</th><th>{_rank_header(rows)}</th><th>incident</th>"
        "<th>decision</th><th>applied</th></tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def _runs_section(s: RunSummary) -> str:
    if len(s.runs) <= 1:
        return ""
    shown = [r for r in s.runs if r.shown]
    if len(shown) > 1:
        what = (
            f"<strong>This summary mixes {_int(len(shown))} runs</strong> (their events were "
            "folded together)."
        )
    else:
        run = shown[0] if shown else None
        label = _e(run.run_id) if run is not None and run.run_id else "events before any session"
        what = (
            f"This log holds <strong>{_int(len(s.runs))} runs</strong>; this report shows "
            f"<code class='rid'>{label}</code>"
            + (" (the latest)" if run is not None and run is s.runs[-1] else "")
            + ". Rebuild another with <code>build_report(log, run=RUN_ID)</code>."
        )

    def row(r: RunInfo) -> str:
        rid = _e(r.run_id) if r.run_id else "<span class='note'>(before any session)</span>"
        ranks = ", ".join(_int(k) for k in r.ranks) or "–"
        return (
            f"<tr class='{'shown' if r.shown else 'other'}'><td><code class='rid'>{rid}</code></td>"
            f"<td>{_e(r.name)}</td><td>{_time(r.started_ns)}</td><td>{ranks}</td>"
            f"<td class='num'>{_int(r.events)}</td><td>{'shown' if r.shown else ''}</td></tr>"
        )

    return (
        f"<div class='banner' id='runs-banner'>{what}</div>"
        "<table id='runs'><thead><tr><th>run id</th><th>session</th><th>started</th>"
        "<th>ranks</th><th>events</th><th></th></tr></thead><tbody>"
        + "".join(row(r) for r in s.runs)
        + "</tbody></table>"
    )


def _ranks_section(s: RunSummary) -> str:
    """The ranks of a merged log: each rank's steps and incidents (the cards count each step
    and each incident once, whichever ranks had it)."""
    steps = s.steps_by_rank if isinstance(s.steps_by_rank, Mapping) else {}
    incidents = s.incidents_by_rank if isinstance(s.incidents_by_rank, Mapping) else {}
    rows = "".join(
        f"<tr><td class='num'>{_int(rank)}</td><td class='num'>{_int(steps.get(rank, 0))}</td>"
        f"<td class='num'>{_int(incidents.get(rank, 0))}</td></tr>"
        for rank in s.ranks
    )
    return (
        f"<h2 id='ranks'>Ranks</h2><p class='note'>{_int(len(s.ranks))} ranks: a step that "
        "every rank completed is one step, an incident that several ranks had (same step, kind "
        "and identity: the same tensors, rule, trigger...) is one row naming them and is counted once; throughput is summed over the "
        "ranks, the other curves are the mean over the ranks.</p>"
        "<table id='ranks-table'><thead><tr><th>rank</th><th>steps</th><th>incidents</th>"
        f"</tr></thead><tbody>{rows}</tbody></table>"
    )


def _ended_banner(s: RunSummary) -> str:
    """Why the run ended, when a rank's session did not complete (stopped, cancelled, failed);
    nothing when every session completed."""
    ended = s.ended if isinstance(s.ended, Mapping) else {}
    bad = {rank: reason for rank, reason in ended.items() if reason != "completed"}
    if not bad:
        return ""
    several = len(s.ranks) > 1
    lines = "".join(
        f"<li>{f'rank {_int(rank)}: ' if several else ''}{_e(reason)}</li>"
        for rank, reason in bad.items()
    )
    last = s.last_completed_step
    done = "no step completed" if last is None else f"the last step completed was {_int(last)}"
    return (
        "<div class='banner' id='ended-banner'><strong>The run did not complete</strong> "
        f"({done}):<ul>{lines}</ul></div>"
    )
