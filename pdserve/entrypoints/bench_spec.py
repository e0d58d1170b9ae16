"""`pdserve bench serve`'s speculative-decoding section (vLLM's): what the server's spec-decode
counters on /metrics gained over the run."""

from __future__ import annotations

import aiohttp

# The server's speculative-decoding counters (pdserve's prefix, or vLLM's for a vLLM peer).
_SPEC_PREFIXES = ("pdserve:spec_decode_", "vllm:spec_decode_")
SPEC_ROWS: list[tuple[str, str, str]] = [
    ("Acceptance rate (%)", "spec_decode_acceptance_rate", ".2f"),
    ("Acceptance length", "spec_decode_acceptance_length", ".2f"),
    ("Drafts", "spec_decode_num_drafts", "d"),
    ("Draft tokens", "spec_decode_num_draft_tokens", "d"),
    ("Accepted tokens", "spec_decode_num_accepted_tokens", "d"),
]
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def fetch_spec_counters(base_url: str, headers: dict[str, str]) -> dict | None:
    """The server's spec-decode counters from /metrics ({"num_drafts": .., ...,
    "per_position": {position: accepted}}), or None where it exports none (no speculation, or
    a proxy)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(base_url.rstrip("/") + "/metrics", headers=headers) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
    except aiohttp.ClientError:
        return None
    counters: dict = {"per_position": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix = next((p for p in _SPEC_PREFIXES if sample.name.startswith(p)), None)
            if prefix is None or not sample.name.endswith("_total"):
                continue
            name = sample.name.removeprefix(prefix).removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                position = int(sample.labels["position"])
                per_position = counters["per_position"]
                per_position[position] = per_position.get(position, 0) + int(sample.value)
            else:
                counters[name] = counters.get(name, 0) + int(sample.value)
    return counters if "num_drafts" in counters else None


def spec_summary(before: dict | None, after: dict | None) -> dict:
    """vLLM's speculative-decoding summary of the run: what the counters gained."""
    if before is None or after is None:
        return {}
    gained = {k: after.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTERS}
    drafts, draft_tokens = gained["num_drafts"], gained["num_draft_tokens"]
    accepted = gained["num_accepted_tokens"]
    positions = sorted(after["per_position"])
    per_position = [after["per_position"][i] - before["per_position"].get(i, 0) for i in positions]
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": draft_tokens,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": 100 * accepted / draft_tokens if draft_tokens else 0.0,
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
        "spec_decode_per_position_acceptance_rate": [
            100 * n / drafts if drafts else 0.0 for n in per_position
        ],
    }


def spec_table_lines(results: list[dict], name_width: int, col_width: int, width: int) -> list[str]:
    """The section's rows, one column per result."""
    lines = ["-" * 15 + "Speculative Decoding" + "-" * (width - 35)]
    for title, key, fmt in SPEC_ROWS:
        lines.append(
            title.ljust(name_width) + "".join(format(r[key], fmt).rjust(col_width) for r in results)
        )
    rates = [r["spec_decode_per_position_acceptance_rate"] for r in results]
    for i in range(max(map(len, rates))):
        lines.append(
            f"Position {i} acceptance (%)".ljust(name_width)
            + "".join((format(r[i], ".2f") if i < len(r) else "-").rjust(col_width) for r in rates)
        )
    return lines
