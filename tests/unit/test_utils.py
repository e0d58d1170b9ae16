from pdserve.utils import get_open_port


def test_open_ports_are_never_handed_out_twice() -> None:
    # The launcher picks every child's ports before any child binds one: among 400 picks from the
    # ~12k ports outside the ephemeral range, a repeat is near certain unless the process remembers.
    ports = [get_open_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)
