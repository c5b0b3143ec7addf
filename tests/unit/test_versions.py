"""Adapter-version bookkeeping rules (pure, milliseconds)."""

from __future__ import annotations

import pytest

from rl_cluster.core.versions import ReplicaState, VersionBook


def book_with(*replicas: str) -> VersionBook:
    book = VersionBook()
    for r in replicas:
        book.add_replica(r)
        book.activate(r)
    return book


def publish_everywhere(book: VersionBook, name: str) -> None:
    for r in book.active():
        book.mark_loaded(r, name)
    book.publish(name, f"/bucket/{name}")


def test_routable_only_once_confirmed_everywhere():
    book = book_with("r0", "r1")
    book.mark_loaded("r0", "v1")
    assert not book.is_routable("v1") and not book.eligible("v1")
    with pytest.raises(ValueError, match="r1"):
        book.publish("v1", "/bucket/v1")
    book.mark_loaded("r1", "v1")
    book.publish("v1", "/bucket/v1")
    assert book.is_routable("v1") and sorted(book.eligible("v1")) == ["r0", "r1"]


def test_base_model_is_served_by_every_active_replica():
    book = book_with("r0", "r1")
    book.add_replica("r2")  # joining: no traffic yet
    assert sorted(book.eligible(None)) == ["r0", "r1"]


def test_joining_replica_must_catch_up_before_active():
    book = book_with("r0")
    publish_everywhere(book, "v1")
    book.add_replica("r1")
    assert book.state("r1") is ReplicaState.JOINING
    assert book.live_adapters() == {"v1": "/bucket/v1"}
    with pytest.raises(ValueError, match="v1"):
        book.activate("r1")
    book.mark_loaded("r1", "v1")
    book.activate("r1")
    assert sorted(book.eligible("v1")) == ["r0", "r1"]
    with pytest.raises(ValueError):
        book.add_replica("r1")


def test_draining_replica_takes_no_new_requests():
    book = book_with("r0", "r1")
    publish_everywhere(book, "v1")
    book.drain("r1")
    assert sorted(book.eligible("v1")) == ["r0"] and sorted(book.eligible(None)) == ["r0"]


def test_close_with_nothing_in_flight_unloads_at_once():
    book = book_with("r0", "r1")
    publish_everywhere(book, "v1")
    assert book.close("v1") == ["r0", "r1"]
    assert not book.is_routable("v1") and not book.eligible("v1")
    assert book.known("v1")  # still loaded until the unloads are confirmed: the name is taken
    book.mark_unloaded("r0", "v1")
    book.mark_unloaded("r1", "v1")
    assert not book.known("v1") and not book.is_closed("v1")
    assert book.ever_loaded_on("r0") == {"v1"} and book.loaded_on("r0") == set()


def test_unload_waits_for_in_flight_to_drain():
    book = book_with("r0", "r1")
    publish_everywhere(book, "v1")
    book.begin("r0", "v1")
    book.begin("r0", "v1")
    book.begin("r0", "v2-other")
    assert book.close("v1") == ["r1"]  # r0 still serves v1
    assert book.end("r0", "v1") is False  # one left
    assert book.end("r0", "v2-other") is False  # another model: irrelevant
    assert book.end("r0", "v1") is True  # drained: unload now
    assert book.in_flight("r0") == 0


def test_end_of_open_adapter_never_asks_for_unload():
    book = book_with("r0")
    publish_everywhere(book, "v1")
    book.begin("r0", "v1")
    assert book.in_flight("r0") == 1 and book.in_flight("r0", "v1") == 1
    assert book.end("r0", "v1") is False
    with pytest.raises(ValueError):
        book.end("r0", "v1")


def test_closed_name_cannot_be_republished_until_gone():
    book = book_with("r0")
    publish_everywhere(book, "v1")
    book.close("v1")
    with pytest.raises(ValueError, match="being unloaded"):
        book.publish("v1", "/bucket/v1")
    with pytest.raises(KeyError):
        book.close("never-loaded")


def test_removed_replica_forgets_its_requests():
    book = book_with("r0", "r1")
    publish_everywhere(book, "v1")
    book.begin("r1", "v1")
    book.close("v1")
    book.mark_unloaded("r0", "v1")
    book.remove_replica("r1")  # forced removal with a request still running
    assert book.end("r1", "v1") is False
    assert not book.known("v1")  # no replica holds it any more
    assert book.replicas() == ["r0"]


def test_replica_lifecycle_through_unhealthy_and_back():
    book = VersionBook()
    book.add_replica("r0")
    book.begin_catch_up("r0")
    assert book.state("r0") is ReplicaState.CATCHING_UP and not book.eligible(None)
    book.activate("r0")
    assert sorted(book.eligible(None)) == ["r0"]

    assert book.mark_unhealthy("r0") is True
    assert book.state("r0") is ReplicaState.UNHEALTHY and not book.eligible(None)
    assert book.mark_unhealthy("r0") is False  # already out
    with pytest.raises(ValueError, match="cannot become active"):
        book.activate("r0")  # back only through catch-up
    book.begin_catch_up("r0")
    book.activate("r0")
    assert book.active() == ["r0"]

    book.drain("r0")
    assert book.mark_unhealthy("r0") is False  # leaving anyway: stays draining
    with pytest.raises(ValueError):
        book.begin_catch_up("r0")
    assert book.mark_unhealthy("gone") is False
    assert book.in_state(ReplicaState.DRAINING) == ["r0"]


def test_unhealthy_replica_does_not_block_publication():
    book = VersionBook()
    for r in ("r0", "r1"):
        book.add_replica(r)
        book.activate(r)
    book.mark_unhealthy("r1")
    book.mark_loaded("r0", "v1")
    book.publish("v1", "/b/v1")  # only active replicas must confirm
    assert sorted(book.eligible("v1")) == ["r0"]
    book.begin_catch_up("r1")
    with pytest.raises(ValueError, match="lacks"):
        book.activate("r1")
    book.mark_loaded("r1", "v1")
    book.activate("r1")
    assert sorted(book.eligible("v1")) == ["r0", "r1"]


def test_active_list_follows_every_state_change_and_is_the_callers_own():
    book = book_with("r0", "r1")
    mine = book.active()
    mine.append("intruder")  # a caller's list: changing it changes nothing in the book
    assert book.active() == ["r0", "r1"]
    book.mark_unhealthy("r1")
    assert book.active() == ["r0"]
    book.begin_catch_up("r1")
    book.activate("r1")
    book.add_replica("r2")
    assert book.active() == ["r0", "r1"]
    book.drain("r0")
    assert book.active() == ["r1"]
    book.remove_replica("r1")
    assert book.active() == [] and not book.eligible(None)
