"""The public surface: ``__all__`` is exactly the public names, and nothing imports vLLM."""

from __future__ import annotations

import subprocess
import sys

import prefixgate


def test_all_lists_exactly_the_public_names():
    public = {n for n in dir(prefixgate) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(prefixgate, n)).__name__ == "module"}
    assert set(prefixgate.__all__) == public - modules
    assert len(prefixgate.__all__) == len(set(prefixgate.__all__))


def test_importing_prefixgate_does_not_import_vllm():
    code = "import sys, prefixgate, prefixgate.sim, prefixgate.testing; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_error_names_its_outcome_and_says_when_it_is_raised():
    for name in prefixgate.__all__:
        obj = getattr(prefixgate, name)
        if isinstance(obj, type) and issubclass(obj, prefixgate.PrefixgateError):
            assert isinstance(obj.outcome, prefixgate.Outcome)
            assert obj.__doc__ and len(obj.__doc__) > 20


def test_every_member_of_an_exported_policy_protocol_is_documented():
    """Protocols users implement (ordering, admission, placement): each method has a docstring and each
    attribute is described in the class docstring."""
    for protocol in (prefixgate.OrderingPolicy, prefixgate.AdmissionPolicy, prefixgate.PlacementPolicy):
        assert protocol.__doc__ and len(protocol.__doc__) > 100
        members = [n for n in vars(protocol) if not n.startswith("_")]
        assert members, protocol
        for name in members:
            assert getattr(protocol, name).__doc__, f"{protocol.__name__}.{name}"
        for name in getattr(protocol, "__annotations__", {}):
            assert f"{name}:" in protocol.__doc__, f"{protocol.__name__}.{name}"
    assert {"check", "release"} <= set(vars(prefixgate.AdmissionPolicy))
