"""Rows → result matrices, gates and the go/no-go verdict (``pd-dflash report``) and upstream's matrix checks
(``pd-dflash validate``). Pure core: no torch, no Ray.

``aggregate`` places rows in upstream's groups ``model|B{b}|c{c}`` and aggregates repeats; ``gates`` evaluates
the go/no-go gates; ``render`` writes JSON/CSV/Markdown; ``plots`` the PNGs; ``build`` ties them together and
writes the files; ``validate`` is upstream's ``validate_result_matrix``.
"""

from pd_dflash.report.build import build_report, effective_gates, read_inputs, write_outputs

__all__ = ["build_report", "effective_gates", "read_inputs", "write_outputs"]
