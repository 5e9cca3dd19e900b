"""The training set declared as SQL: a select-project-join query (or a UNION ALL of them) over the owners'
tables, compiled into the relational spec (tpflower.schema); see docs/datasets.md, "The training set as SQL"."""

from tpflower.sql.compile import compile_query, query_tables
from tpflower.sql.predicate import filter_rows, row_mask
from tpflower.sql.query import QueryError

__all__ = ["QueryError", "compile_query", "filter_rows", "query_tables", "row_mask"]
