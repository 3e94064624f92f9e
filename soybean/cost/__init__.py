"""The cost model: what a plan costs on a machine.

* :mod:`.collectives` -- bytes and seconds of every reshard step, forward and backward (alpha-beta, ring).
* :mod:`.compute` -- an op's training-step time (roofline x passes, page faults) and the optimizer step.
* :mod:`.memory` -- bytes per device a tiling keeps.
* :mod:`.profiles` -- machine profiles (built-in and calibrated).
* :mod:`.calibrate` -- measuring a profile on the current backend.
"""
