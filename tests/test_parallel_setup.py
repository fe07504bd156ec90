"""`init_distributed` for one process: no port outside torchrun, torchrun's rendezvous under it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(
    """
    import os, socket
    import torch
    import torch.distributed as dist
    from mcore_rl.parallel.setup import destroy, init_distributed

    def default_store():
        store = dist.distributed_c10d._get_default_store()
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        return store

    # outside torchrun: an in-process store, so runs started together never race for a port
    assert init_distributed() == (0, 1)
    store = default_store()
    assert isinstance(store, dist.HashStore), type(store)
    assert "MASTER_PORT" not in os.environ
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    destroy()

    # a rendezvous given in the environment (torchrun's, one rank) is used as given
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    assert init_distributed() == (0, 1)
    store = default_store()
    assert isinstance(store, dist.TCPStore) and store.port == port, type(store)
    destroy()
    print("OK")
    """
)


def test_one_process_needs_no_port_and_torchruns_rendezvous_is_kept() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-3000:]
