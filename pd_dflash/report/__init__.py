"""Rows → result matrices, gates and the go/no-go verdict (``pd-dflash report``) and upstream's matrix checks
(``pd-dflash validate``). Pure core: no torch, no Ray.

``brief`` keeps the few fields of a row the report needs; ``aggregate`` places rows in upstream's groups
``model|B{b}|c{c}`` and aggregates repeats; ``gates`` evaluates the go/no-go gates; ``matrix_json`` streams
result_matrix.json; ``render`` writes CSV/Markdown; ``plots`` the PNGs; ``build`` ties them together and writes
the files; ``validate`` is upstream's ``validate_result_matrix`` plus the group-key check; ``bm1`` is
upstream's row-level BM1 (``summarise_row``).
"""

from pd_dflash.report.bm1 import bm1_summary
from pd_dflash.report.build import build_report, effective_gates, open_inputs, write_outputs

__all__ = ["bm1_summary", "build_report", "effective_gates", "open_inputs", "write_outputs"]
