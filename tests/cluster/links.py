"""Named link profiles of the emulated cluster: a bandwidth that ``tc`` enforces, and a latency.

A profile is what one emulated node's cable offers, per direction. The bandwidth is shaped with a
token bucket (``tc qdisc tbf``) on both ends of the node's veth pair. This kernel has no ``netem``,
so the latency is **not** injected: a measurement on the emulated cluster carries the veth's own
latency (tens of µs through the kernel's TCP stack), and the projection to many nodes uses the
profile's published latency as α, said so in the report. A profile faster than this machine's veth
can carry (measured: see ``benchmarks/results/multinode_scaling*``) is measured unshaped, at the
veth's limit, and extrapolated by the fitted α–β model.

Sources of the figures (link rates are the standards'; latencies are typical MPI half-round-trip
figures, not a guarantee of any one site):

- ``1gbe``: IEEE 802.3ab, 1 Gb/s; "Gigabit Ethernet: ~40 to ~300 µs" (Aspen Systems, HPC
  glossary "Low latency"), 50 µs taken.
- ``10gbe``: IEEE 802.3ae, 10 Gb/s; the same source: "10 Gigabit Ethernet normally has about the
  same latencies as Gigabit Ethernet", 40 µs taken.
- ``ib-hdr``: InfiniBand HDR (IBTA, 4× lanes), 200 Gb/s; "InfiniBand: ~1 µs to ~5 µs" (same
  source), 1 µs taken (a current HCA's MPI latency; ``hpcfl bench scaling``'s default InfiniBand
  projection keeps its more conservative α = 2 µs, β = 10 GB/s after MPI overheads).
- ``veth``: unshaped, this machine's kernel veth (its figures are measured, not assumed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a node's link: ``rate_bit_s`` (None: unshaped) and a latency (not injected)."""

    name: str
    rate_bit_s: float | None
    latency_s: float | None
    source: str

    @property
    def shaped(self) -> bool:
        return self.rate_bit_s is not None

    def tbf_args(self) -> list[str]:
        """``tc qdisc ... root`` arguments of a token bucket at this rate.

        The bucket holds 200 µs of traffic, at least 68 KiB (veth hands up to 64 KiB GSO segments to
        the qdisc; a bucket smaller than a segment would stall it); packets wait at most 100 ms. A
        larger bucket lets messages below its size through at the veth's speed (measured: a 500 KB
        bucket made a "1 Gb/s" link carry 128 KiB allreduces at 1.6 GB/s), which is no link's
        behaviour and spoils the α–β fit.
        """
        assert self.rate_bit_s is not None
        burst = max(int(self.rate_bit_s / 8 * 200e-6), 68 * 1024)
        return ["tbf", "rate", f"{int(self.rate_bit_s)}bit", "burst", str(burst), "latency", "100ms"]

    def describe(self) -> str:
        rate = "unshaped" if self.rate_bit_s is None else f"{self.rate_bit_s / 1e9:g} Gb/s"
        lat = (
            ""
            if self.latency_s is None
            else f", {self.latency_s * 1e6:g} µs latency (projected, not injected)"
        )
        return f"{self.name}: {rate}{lat}"


LINK_PROFILES: dict[str, LinkProfile] = {
    "veth": LinkProfile("veth", None, None, "this machine's kernel veth, unshaped (measured)"),
    "1gbe": LinkProfile(
        "1gbe", 1e9, 50e-6, "IEEE 802.3ab 1 Gb/s; GbE MPI latency ~40-300 µs (Aspen Systems)"
    ),
    "10gbe": LinkProfile("10gbe", 10e9, 40e-6, "IEEE 802.3ae 10 Gb/s; latency about GbE's (Aspen Systems)"),
    "ib-hdr": LinkProfile(
        "ib-hdr", 200e9, 1e-6, "InfiniBand HDR 4x 200 Gb/s; IB latency ~1-5 µs (Aspen Systems)"
    ),
}

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_link(spec: str | LinkProfile | None) -> LinkProfile | None:
    """A profile by name (``10gbe``), or explicit values ``rate=100mbit[,latency=200us]``.

    Raises ValueError with one line naming the known profiles for anything else.
    """
    if spec is None or isinstance(spec, LinkProfile):
        return spec
    key = spec.strip().lower()
    if key in LINK_PROFILES:
        return LINK_PROFILES[key]
    fields = dict(part.split("=", 1) for part in key.split(",") if "=" in part)
    if fields and set(fields) <= {"rate", "latency"} and len(fields) == key.count("=") and "rate" in fields:
        rate = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([kmg]?)bit", fields["rate"])
        latency = re.fullmatch(r"([0-9.]+)\s*(us|ms|s)", fields.get("latency", "0us"))
        if rate and latency:
            bits = float(rate.group(1)) * _UNITS[rate.group(2)]
            secs = float(latency.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[latency.group(2)]
            if bits >= 1e3:
                return LinkProfile(key, bits, secs or None, "explicit values")
    known = ", ".join(LINK_PROFILES)
    raise ValueError(f"unknown link profile {spec!r}: use one of {known}, or rate=100mbit[,latency=200us]")
