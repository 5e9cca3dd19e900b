"""Print the dataset YAML a training query compiles to (tpflower.sql), for review by the table owners and for a
deployment, whose nodes take a plain dataset spec::

    python -m simulations.sql dataset=nycflights13_sql
    python -m simulations.sql dataset=sql 'dataset.sql="SELECT r.rating AS label, m.genre FROM ratings r JOIN movies m USING (movieId)"'
    python -m simulations.sql --config-dir ~/mydata/conf dataset=shop_sql > ~/mydata/conf/dataset/shop.yaml

The first line is the normalized query as a YAML comment; the output is a dataset config (``dataset=NAME``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from simulations.run import choices, unknown_choice
from tpflower.config import compose_config
from tpflower.config_errors import override_error
from tpflower.datasets import compile_sql
from tpflower.overrides import searchpath_override
from tpflower.schema import SpecError


def compiled_yaml(overrides: Sequence[str], config_dir: str | None = None, base_dir: str | Path | None = None) -> str:
    """The compiled dataset config of the run config ``overrides`` select, as YAML text."""
    if config_dir is not None:
        overrides = [searchpath_override(config_dir), *overrides]
    try:
        cfg = compose_config(*overrides)
    except (HydraException, OmegaConfBaseException) as exc:  # an unknown dataset or key: one line
        wrong = unknown_choice(choices(list(overrides))[0], [config_dir] if config_dir else [])
        raise SpecError(wrong or override_error(exc, list(overrides), base_dir)) from None
    if not cfg.dataset.get("sql"):
        raise SpecError(
            f"dataset {cfg.dataset.get('name')!r} has no sql: it is a dataset spec already; give a dataset that "
            'holds a query (dataset=sql, dataset=nycflights13_sql), or the query: +dataset.sql="SELECT ..."'
        )
    compiled = compile_sql(cfg.dataset, base_dir)
    notes = "".join(f"# warning: {note}\n" for note in compiled.pop("notes", ()))
    return f"# query: {compiled['query']}\n{notes}{OmegaConf.to_yaml(OmegaConf.create(compiled))}"


def main(argv: Sequence[str] | None = None, prog: str = "python -m simulations.sql") -> int:
    # the docstring's first paragraph (its first line alone stopped mid-sentence), its closing '::' a full stop
    description = " ".join(__doc__.split("\n\n")[0].split()).removesuffix("::") + "."
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config-dir", help="a folder with dataset/NAME.yaml files (as simulations.run takes)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dataset=sql dataset.sql=...")
    args = parser.parse_args(argv)
    try:
        print(compiled_yaml(args.overrides, args.config_dir, base_dir=Path.cwd()), end="")
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
