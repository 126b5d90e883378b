"""`kernels/stage_inputs.py` (a decode step's inputs into a CUDA graph's buffers, one launch) against its torch
reference: placeholders from the previous step's ids, block-table rows gathered up to the width in use,
padded rows of the bucket, and nothing else touched."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.stage_inputs import stage_decode_inputs


def _buffers(cap: int, max_blocks: int, device: str, g: torch.Generator) -> list[torch.Tensor]:
    # Stale contents everywhere: what the kernel must not write stays as it was.
    return [torch.randint(0, 1 << 20, (cap,), generator=g).to(device),
            torch.randint(0, 1 << 20, (cap,), generator=g).to(device),
            torch.randint(0, 1 << 20, (cap,), generator=g).to(device),
            torch.randint(0, 1 << 20, (cap,), generator=g).to(torch.int32).to(device),
            torch.randint(0, 1 << 20, (cap, max_blocks), generator=g).to(torch.int32).to(device)]


@pytest.mark.parametrize("n, bucket, width, num_fix", [
    (5, 8, 3, 3),  # some rows are placeholders, three padded rows, a narrow table
    (16, 16, 1, 0),  # no placeholders (prev_ids None), no padding
    (300, 304, 150, 300),  # every row a placeholder: more than one scan block; a table wider than one copy block
    (1, 1, 2, 1),
])
def test_stage_matches_reference(device, n, bucket, width, num_fix):
    g = torch.Generator().manual_seed(n * 7 + width)
    cap, max_blocks, table_rows = 320, 160, 400
    ids = torch.randint(0, 50_000, (n,), generator=g)
    fix_rows = torch.randperm(n, generator=g)[:num_fix].sort().values
    ids[fix_rows] = -1  # PLACEHOLDER
    prev_ids = torch.randint(0, 50_000, (n + 7,), generator=g)
    fix_src = torch.randperm(n + 7, generator=g)[:num_fix]
    step = [ids, torch.randint(0, 4096, (n,), generator=g), torch.randint(0, 10_000, (n,), generator=g),
            torch.randint(1, 4096, (n,), generator=g), torch.randperm(table_rows, generator=g)[:n], fix_rows, fix_src]
    step = [t.to(device) for t in step]
    table = torch.randint(0, 5000, (table_rows, max_blocks), generator=g, dtype=torch.int32).to(device)
    prev = prev_ids.to(device) if num_fix else None
    out = _buffers(cap, max_blocks, device, g)
    ref = [t.clone() for t in out]
    stage_decode_inputs(*step, prev, table, width, *out, bucket)
    reference.stage_decode_inputs(*step, prev, table, width, *ref, bucket)
    for got, want, name in zip(out, ref, ("ids", "positions", "slots", "seq_lens", "tables")):
        assert torch.equal(got, want), name
    # The reference's own meaning, spelled out: placeholders resolved, padding, stale beyond.
    want_ids = step[0].clone()
    if num_fix:
        want_ids[step[5]] = prev[step[6]]
    assert torch.equal(out[0][:n], want_ids) and not (out[0][:n] == -1).any()
    assert torch.equal(out[4][:n, :width], table[step[4], :width])
    assert out[2][n:bucket].eq(-1).all() and out[3][n:bucket].eq(0).all()
    assert torch.equal(out[2][bucket:], ref[2][bucket:]) and torch.equal(out[4][:n, width:], ref[4][:n, width:])


def test_stage_refuses_placeholders_without_previous_ids(device):
    one = torch.zeros(1, dtype=torch.int64, device=device)
    bufs = _buffers(4, 4, device, torch.Generator().manual_seed(0))
    table = torch.zeros(2, 4, dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="placeholders"):
        stage_decode_inputs(one, one, one, one, one, one, one, None, table, 1, *bufs, 1)
