"""Reports: a plan as a table, explained per op, drawn, and diffed."""
