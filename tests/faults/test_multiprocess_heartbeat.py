"""mxc run --heartbeat-timeout reaches jax.distributed.initialize (issue 22)."""
import jax

from mxc.runtime import distributed
from mxc.runtime.cli import build_parser


def test_heartbeat_timeout_is_passed_to_jax_distributed(monkeypatch):
    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(distributed, "_gloo_on_loopback", lambda: None)
    args = build_parser().parse_args(["run", "ART", "--data", "t.bin", "--ckpt-dir", "c", "--steps", "1",
                                      "--heartbeat-timeout", "7"])
    distributed.initialize(distributed.setup_from("127.0.0.1:1234", 2, 0), heartbeat_timeout_s=args.heartbeat_timeout)
    assert seen["heartbeat_timeout_seconds"] == 7
