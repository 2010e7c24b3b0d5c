"""Turn the measured series into Markdown tables and PASS/MISS target lines.

Every ratio is the median over rounds of ``contender_i / baseline_i`` (the two were measured
moments apart, in the same round); medians of the series are shown alongside.
"""

from __future__ import annotations

from typing import Any

from _common import GiB, MiB, median, paired_ratio, round_min


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None else fmt.format(x)


class Report:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.targets: list[dict[str, Any]] = []

    def add(self, line: str = "") -> None:
        self.lines.append(line)

    def table(self, title: str, rows: list[tuple[str, list | None, list | None, str]],
              nbytes: int, unit: str = "GiB/s") -> None:
        """rows: (label, series, baseline series or None, note)."""
        self.add(f"**{title}**")
        self.add("")
        self.add(f"| contender | median s | {unit} | ratio vs baseline | note |")
        self.add("|---|---:|---:|---:|---|")
        for label, series, base, note in rows:
            if series is None or median(series) is None:
                self.add(f"| {label} | failed | | | {note} |")
                continue
            med = median(series)
            rate = nbytes / med / (GiB if unit == "GiB/s" else MiB) if med > 0 else None
            ratio = paired_ratio(series, base) if base is not None else None
            self.add(f"| {label} | {med:.3f} | {_f(rate, '{:.2f}')} | "
                     f"{_f(ratio, '{:.2f}x') if base is not None else 'baseline'} | {note} |")
        self.add("")

    def target(self, name: str, size: str, value: float | None, limit: float,
               higher_is_better: bool = False, fmt: str = "{:.2f}x", why: str = "") -> None:
        if value is None:
            verdict = "n/a"
        elif higher_is_better:
            verdict = "PASS" if value >= limit else "MISS"
        else:
            verdict = "PASS" if value <= limit else "MISS"
        self.targets.append({"target": name, "size": size, "value": value, "limit": limit,
                             "higher_is_better": higher_is_better, "result": verdict,
                             "fmt": fmt, "why": why})

    def targets_table(self) -> None:
        self.add("### Targets")
        self.add("")
        self.add("| target | size | measured | limit | result |")
        self.add("|---|---|---:|---:|---|")
        for t in self.targets:
            op = ">=" if t["higher_is_better"] else "<="
            self.add(f"| {t['target']} | {t['size']} | {_f(t['value'], t['fmt'])} | "
                     f"{op} {t['fmt'].format(t['limit'])} | **{t['result']}** |")
        self.add("")

    def text(self) -> str:
        return "\n".join(self.lines)


def local_section(rep: Report, label: str, nbytes: int, res: dict[str, Any]) -> None:
    st = res.get("steady", {}).get("series")
    if st:
        s = st.get
        nfiles = res["steady"]["info"].get("raw_write_files", 4)
        floor_w = round_min(s("raw_write_1", []), s(f"raw_write_{nfiles}", []))
        dcp_names = sorted(k for k in st if k.startswith("dcp_save_t"))
        best_dcp = min(dcp_names, key=lambda k: median(st[k]) or float("inf"), default=None)
        rep.table(f"{label}: stall (time the training loop is blocked), steady state", [
            ("copy into preallocated buffers (floor)", s("copy_floor"), None,
             res["steady"]["info"].get("copy_floor_target", "")),
            ("ours: CheckpointManager.save() returns", s("ours.stall"), s("copy_floor"),
             "whole call"),
            ("ours: staging copy (its save_staged event)", s("ours.stage"), s("copy_floor"), ""),
            ("dcp.async_save returns", s("dcp_async.stall"), s("copy_floor"),
             "allocates its CPU copy every save"),
        ], nbytes)
        rep.table(f"{label}: persist (until durable), steady state", [
            ("raw write + fsync (floor: best of 1 file / N files per round)", floor_w, None,
             f"N = {nfiles}"),
            ("raw write, 1 file", s("raw_write_1"), floor_w, ""),
            (f"raw write, {nfiles} files in {nfiles} threads", s(f"raw_write_{nfiles}"),
             floor_w, ""),
            (f"raw write + crc32c, {nfiles} files in {nfiles} threads",
             s(f"raw_write_crc_{nfiles}"), floor_w, "crc first, then write"),
            ("ours: save() until committed (checksums on)", s("ours.commit"), floor_w,
             "stage + persist + manifest"),
            ("ours: save() until wait() returns", s("ours.wait"), floor_w, "+ retention"),
            ("torch.save + fsync", s("torch_save"), floor_w, "one file"),
            *[(f"dcp.save FileSystemWriter thread_count={k[len('dcp_save_t'):]}", s(k),
               floor_w, "best DCP" if k == best_dcp else "") for k in dcp_names],
            ("dcp.async_save until done", s("dcp_async.total"), floor_w, ""),
        ], nbytes)
        rep.target("stall <= 1.1x buffer copy (steady)", label,
                   paired_ratio(s("ours.stall", []), s("copy_floor", [])), 1.1)
        rep.target("total local save <= 1.1x raw write floor", label,
                   paired_ratio(s("ours.commit", []), floor_w), 1.1)
        if best_dcp:
            rep.add(f"ours (commit) vs best dcp.save ({best_dcp}): "
                    f"{_f(paired_ratio(s('ours.commit', []), st[best_dcp]), '{:.2f}x')}; "
                    f"vs torch.save+fsync: "
                    f"{_f(paired_ratio(s('ours.commit', []), s('torch_save', [])), '{:.2f}x')}")
            rep.add("")
    fs = res.get("first", {}).get("series")
    if fs:
        rep.table(f"{label}: first save's stall (fresh manager)", [
            ("copy into preallocated buffers (floor)", fs.get("copy_floor"), None, ""),
            ("ours: first save, no prepare()", fs.get("ours_first"), fs.get("copy_floor"),
             "allocates + faults in buffers"),
            ("ours: first save after prepare()", fs.get("ours_first_prepared"),
             fs.get("copy_floor"), "as the trainer does"),
        ], nbytes)
        rep.target("first save's stall <= 1.5x buffer copy (no prepare)", label,
                   paired_ratio(fs.get("ours_first", []), fs.get("copy_floor", [])), 1.5)
        rep.target("first save's stall <= 1.5x buffer copy (after prepare)", label,
                   paired_ratio(fs.get("ours_first_prepared", []), fs.get("copy_floor", [])), 1.5)
    ld = res.get("load", {})
    nfiles = ld.get("info", {}).get("raw_read_files", 4)
    for mode in ("cold", "warm"):
        ls = ld.get(mode)
        if not ls:
            continue
        floor_r = round_min(ls.get("raw_read_1", []), ls.get(f"raw_read_{nfiles}", []))
        rep.table(f"{label}: load, {mode} page cache", [
            ("raw read into the tensors (floor: best of 1 / N files)", floor_r, None, ""),
            ("ours verify=full", ls.get("ours_full"), floor_r, "crc32c of every byte"),
            ("ours verify=size", ls.get("ours_size"), floor_r, ""),
            ("ours verify=none", ls.get("ours_none"), floor_r, ""),
            ("dcp.load (FileSystemReader)", ls.get("dcp_load"), floor_r, ""),
            ("torch.load(weights_only=True)", ls.get("torch_load"), floor_r,
             "allocates new tensors"),
        ], nbytes)
        rep.target(f"load (full verify) no slower than dcp.load, {mode}", label,
                   paired_ratio(ls.get("ours_full", []), ls.get("dcp_load", [])), 1.0)
        rep.target(f"full verification adds <= 30% (full/none), {mode}", label,
                   paired_ratio(ls.get("ours_full", []), ls.get("ours_none", [])), 1.3)
    if ld.get("info", {}).get("cold"):
        rep.add(f"Cold-cache loads: {ld['info']['cold']}")
        rep.add("")


def s3_section(rep: Report, label: str, nbytes: int, res: dict[str, Any]) -> None:
    st = res.get("series") or {}
    names = [k for k in st if "." not in k]  # "<name>.cpu_*" are per-sample CPU seconds
    dcp_names = sorted(k for k in names if k.startswith("dcp_fsspec_t"))
    ours_names = sorted(k for k in names if k.startswith("ours_t"))
    main_dcp = "dcp_fsspec_t4" if "dcp_fsspec_t4" in st else (dcp_names[-1] if dcp_names
                                                                  else None)
    info = res.get("info", {})
    rows = [
        (f"raw concurrent put, {info.get('raw_objects')} objects, "
         f"{info.get('raw_threads')} threads", "raw_put", None, "floor"),
        ("ours: ckpt.save to s3://", "ours", "raw_put",
         f"num_threads={info.get('ours_threads')} (default)"),
        *[(f"ours: ckpt.save, num_threads={k[len('ours_t'):]}", k, "raw_put", "")
          for k in ours_names],
        *[(f"dcp.save FsspecWriter thread_count={k[len('dcp_fsspec_t'):]}", k, "raw_put", "")
          for k in dcp_names],
    ]
    rep.table(f"{label}: save to S3 (moto on loopback)",
              [(lbl, st.get(k), st.get(b) if b else None, note) for lbl, k, b, note in rows],
              nbytes, unit="MiB/s")
    if any(f"{k}.cpu_server" in st for _, k, _, _ in rows):
        # moto is CPU-bound on the same cores: wall time is about (client + server CPU) over
        # the cores, so these columns say which side a difference comes from.
        rep.add(f"CPU seconds per save, median (client: the bench process; server: the moto "
                f"process; {info.get('cpus', '?')} cores shared by both):")
        rep.add("")
        rep.add("| contender | client CPU s | server CPU s | client + server |")
        rep.add("|---|---:|---:|---:|")
        for lbl, k, _, _ in rows:
            c, v = median(st.get(f"{k}.cpu_client") or []), median(st.get(f"{k}.cpu_server") or [])
            rep.add(f"| {lbl} | {_f(c, '{:.2f}')} | {_f(v, '{:.2f}')} | "
                    f"{_f(None if c is None or v is None else c + v, '{:.2f}')} |")
        rep.add("")
    # Throughput ratio = inverse time ratio. The default configuration is the target; other
    # num_threads settings are listed too, marked as such.
    threads = info.get("ours_threads")
    for key in ["ours"] + ours_names:
        which = (f"num_threads={threads}, default" if key == "ours"
                 else f"num_threads={key[len('ours_t'):]}")
        if main_dcp:
            r = paired_ratio(st.get(main_dcp, []), st.get(key, []))
            rep.target(f"S3 throughput >= 2x DCP fsspec writer ({main_dcp}); ours {which}",
                       label, r, 2.0, higher_is_better=True)
        r = paired_ratio(st.get("raw_put", []), st.get(key, []))
        rep.target(f"S3 throughput >= 0.8x raw concurrent upload; ours {which}", label, r, 0.8,
                   higher_is_better=True)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def train_section(rep: Report, res: dict[str, Any]) -> None:
    st = res.get("series") or {}
    info = res.get("info", {})
    rep.add(f"**Training: {info.get('ranks')} ranks, {info.get('config')} "
            f"{' '.join(info.get('extra_args', []))}, {info.get('steps')} steps, window from "
            f"step {info.get('warmup_steps')}**")
    rep.add("")
    rep.add("| checkpointing | median s/step | overhead vs never | ms/step outside train_step "
            "| saves in window | stall s (sum) | checkpoint bytes/rank |")
    rep.add("|---|---:|---:|---:|---:|---:|---:|")
    base = st.get("never.step")
    for v, label in (("never", "never"), ("every", f"every {info.get('every')} steps"),
                     ("auto", "interval=auto")):
        s = st.get(f"{v}.step")
        if not s or median(s) is None:
            rep.add(f"| {label} | failed | | | | | |")
            continue
        ov = paired_ratio(s, base)
        rep.add(f"| {label} | {median(s):.4f} | "
                f"{'baseline' if v == 'never' else _f((ov - 1) * 100 if ov else None, '{:+.1f}%')}"
                f" | {_f(_ms(median(st.get(f'{v}.outside_mean', []))), '{:.2f}')}"
                f" | {_f(median(st.get(f'{v}.saves', [])), '{:.0f}')} | "
                f"{_f(median(st.get(f'{v}.stall_sum', [])), '{:.3f}')} | "
                f"{_f(median(st.get(f'{v}.save_bytes', [])), '{:.0f}')} |")
    rep.add("")
    _train_cost(rep, st, info)
    model = " ".join(info.get("extra_args", [])) or "tiny model"
    for v, limit in (("auto", 0.02), ("every", None)):
        r = paired_ratio(st.get(f"{v}.step", []), base or [])
        if limit is not None:
            rep.target("training overhead <= 2% with interval=auto", model,
                       None if r is None else (r - 1) * 100, limit * 100, fmt="{:+.1f}%")
        else:
            share = median(st.get(f"{v}.stall_share", []))
            if share is not None:
                rep.target(f"overhead, a save every {info.get('every')} steps <= stall share + "
                           f"1% ({share * 100:.2f}% + 1%)", model,
                           None if r is None else (r - 1) * 100, (share + 0.01) * 100,
                           fmt="{:+.1f}%")


def _per(xs: list, ns: list) -> list:
    return [x / n for x, n in zip(xs, ns) if x is not None and n]


def _train_cost(rep: Report, st: dict[str, Any], info: dict[str, Any]) -> None:
    """Per save: what the background took from training, and where (rank 0's save_cost)."""
    base = st.get("never.step")
    rows = []
    # Only the every-k variant: interval=auto saves once or twice in the window, too few to
    # tell its cost from the noise of the step time.
    for v, label in (("every", f"every {info.get('every')} steps"),):
        s, saves, n = st.get(f"{v}.step"), st.get(f"{v}.saves"), st.get(f"{v}.window_steps")
        if not s or not base or not saves or median(st.get(f"{v}.cost.background_cpu_seconds",
                                                           [])) is None:
            continue
        # Training time lost per save, round by round: (window - never's window) / saves.
        lost = [((a - b) * k / m) if None not in (a, b, k, m) and m else None
                for a, b, k, m in zip(s, base, n or [], saves)]
        phases = [k.split(".", 3)[3] for k in st if k.startswith(f"{v}.cost.cpu.")]
        cpu = ", ".join(f"{p} {_ms(median(st[f'{v}.cost.cpu.{p}'])):.1f}" for p in phases)
        wall = ", ".join(f"{p} {_ms(median(st[f'{v}.cost.wall.{p}'])):.1f}" for p in phases)
        rows.append(f"| {label} | {_f(_ms(median(lost)), '{:.1f}')} | "
                    f"{_f(_ms(median(_per(st.get(f'{v}.stall_sum', []), saves))), '{:.1f}')} | "
                    f"{_f(_ms(median(st[f'{v}.cost.background_cpu_seconds'])), '{:.1f}')} | "
                    f"{_f(_ms(median(st[f'{v}.cost.process_cpu_seconds'])), '{:.1f}')} | "
                    f"{_f(_ms(median(st[f'{v}.cost.total_wall_seconds'])), '{:.1f}')} | "
                    f"{cpu} | {wall} |")
    if not rows:
        return
    rep.add("Per save (ms; medians over rounds of rank 0's per-save means; phases from its "
            "`save_cost` event):")
    rep.add("")
    rep.add("| checkpointing | training time lost per save | stall per save | background CPU "
            "(persist + helper threads) | process CPU during the save (all threads) | "
            "background wall | CPU by phase | wall by phase |")
    rep.add("|---|---:|---:|---:|---:|---:|---|---|")
    for row in rows:
        rep.add(row)
    rep.add("")


def rss_section(rep: Report, label: str, res: dict[str, Any]) -> None:
    rep.add(f"**{label}: resident memory (each in a fresh process)**")
    rep.add("")
    rep.add("| contender | extra peak RSS | x shard | RSS growth | note |")
    rep.add("|---|---:|---:|---:|---|")
    notes = {"ours": "async manager, N saves each followed by wait()",
             "ours_load": "ckpt.load verify=full", "dcp_load": "dcp.load, FileSystemReader",
             "dcp_save": "3 saves, thread_count=4",
             "dcp_async": "3 saves", "torch_save": "3 saves"}
    for mode, r in res.items():
        if "error" in r:
            rep.add(f"| {mode} | failed | | | {r['error'][:80]} |")
            continue
        growth = r.get("growth_bytes")
        num = len(r.get("rss_after_each", []))
        grown = "–" if growth is None else f"{growth / MiB:+.1f} MiB over {num} saves"
        reset = "" if r.get("peak_reset") else " (peak not reset)"
        rep.add(f"| {mode} | {r['extra_peak_bytes'] / MiB:.0f} MiB | "
                f"{r['extra_peak_ratio']:.2f} | {grown} | {notes.get(mode, '')}{reset} |")
    rep.add("")
    ours = res.get("ours", {})
    if "extra_peak_ratio" in ours:
        rep.target("extra RSS <= 1.1x shard during save", label, ours["extra_peak_ratio"], 1.1)
        shard = ours["shard_bytes"]
        g = ours.get("growth_bytes")
        allowed = max(4 * MiB, 0.01 * shard)
        rep.target(f"no RSS growth over {len(ours['rss_after_each'])} saves "
                   f"(<= {allowed / MiB:.0f} MiB)", label,
                   None if g is None else g / MiB, allowed / MiB, fmt="{:+.1f} MiB")
