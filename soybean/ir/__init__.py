"""The vocabulary planning, codegen and the runtime share, importing none of them.

* :mod:`.kinds` -- reshard steps and the table of collective kinds (placement change, forward collective,
  adjoint, arguments); the runtime registers each kind's call (``runtime.kinds.CALLS``).
* :mod:`.algorithms` -- the collective algorithms' names and cost terms (rounds, bytes, lp chunks); they run
  in ``runtime.algorithms``.
* :mod:`.syncnorm` -- synchronised batch norm's statistics bytes; the op runs in ``runtime.syncnorm``.
* :mod:`.transfers` -- whole values moved between placed regions' device groups: the forward and the adjoint's
  point-to-point pairs; priced by ``placement_plan``, sent by ``runtime.transfer``.
* :mod:`.experts` -- the routed-experts op (mixture of experts): its serial meaning and its body as data; split
  over ranks it runs in ``runtime.experts``.

Planning (capture, graph, rules, cost, search, planner, plan, reshard) imports this package and never
``soybean.runtime`` or ``soybean.codegen`` (``tests/test_layering.py``).
"""
