"""What the GPU phase probes (probe_bwd_phases.py, probe_fwd_phases.py) share: a Gluon template rendered with SM-clock
stamps inserted at its phase boundaries, found by their source text.

Each consumer warpgroup of the first NPROG programs writes the SM clock (%clock64) into a buffer at
[program, warpgroup, slot, field] (int64, NPROG x warpgroups x NSLOT x fields; warpgroups 2, or 3 for the forward's
wide items), for slots (tiles) 0 .. NSLOT - 1."""

from flexlite.codegen.render import TEMPLATE_DIR

NPROG = 8
STAMP = '''

@gluon.jit
def dbg_stamp(i, WG: gl.constexpr, FIELD: gl.constexpr):
    pid = gl.program_id(0)
    if (pid < {nprog}) & (i >= 0) & (i < {nslot}):
        addr = ((pid * {nwg} + WG) * {nslot} + i) * {nf} + FIELD
        addr = addr.to(gl.int64) * 8 + {base}
        gl.inline_asm_elementwise("mov.u64 $0, %clock64; st.global.u64 [$1], $0;", "=l,l", [addr], dtype=gl.int64,
                                  is_pure=False, pack=1)
'''


def stamped_template(template: str, fields: tuple, after: tuple, before: tuple, anchor: str, nslot: int,
                     base: int, warpgroups: int = 2) -> str:
    """``template`` (a file under flexlite/codegen/templates) with a stamp of field f at slot expression e after the
    first line of each (point, indentation, f, e) of ``after`` and before each of ``before`` (a point is source text
    found exactly once: the probe fails if a template change moved it), the stamping function before ``anchor``,
    writing to the buffer at address ``base`` ([NPROG, warpgroups, nslot, fields])."""
    text = (TEMPLATE_DIR / template).read_text()

    def stamp(indent, field, slot):
        return " " * indent + f"dbg_stamp({slot}, WG, {fields.index(field)})\n"
    for points, place in ((after, "after"), (before, "before")):
        for point, indent, field, slot in points:
            assert text.count(point) == 1, f"insertion point not found once: {point.strip()}"
            if place == "after":
                head, _, rest = point.partition("\n")
                text = text.replace(point, head + "\n" + stamp(indent, field, slot) + rest)
            else:
                text = text.replace(point, stamp(indent, field, slot) + point)
    assert text.count(anchor) == 1, f"anchor not found once: {anchor.strip()}"
    stamp_fn = STAMP.format(nprog=NPROG, nwg=warpgroups, nslot=nslot, nf=len(fields), base=base)
    return text.replace(anchor, stamp_fn + anchor)


def fields_of(t, fields: tuple) -> dict:
    """The stamps t [NPROG, warpgroups, slots, fields] per field name."""
    return {name: t[..., n] for n, name in enumerate(fields)}


def phase_medians(f: dict, names: tuple, present) -> dict:
    """Median clocks between consecutive stamps of ``names`` ({"a->b": clocks}) over the slots where ``present`` and
    the later stamp are set."""
    out = {}
    for a, b in zip(names, names[1:]):
        ok = present & (f[b] > 0)
        out[f"{a}->{b}"] = float((f[b] - f[a])[ok].median())
    return out
