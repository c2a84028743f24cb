"""Observing a run: what it communicates (:mod:`.comm_ledger`)."""

from lightning_zeromoe.observe.comm_ledger import CommLedger, StepComm

__all__ = ["CommLedger", "StepComm"]
