"""Grid carbon-intensity inputs: the bundled region tables and the start-up choice of one intensity.

The tables (``data/grid-carbon-intensity-by-country.csv``, ``data/cloud-region-carbon-intensity.csv``)
are facts with a stated source and year; ``data/SOURCES.md`` carries their attribution. This module only
reads the package's own data files and the ``--carbon.intensity-file`` it is given: it never reaches the
network and never guesses a region. ``resolve_intensity`` runs at start-up so that an unknown region or an
unreadable intensity file stops the exporter before anything starts.

Priority of the intensity used (first that is set wins):
  1. ``--carbon.intensity-file`` (re-read by the carbon collector whenever it changes),
  2. ``--carbon.intensity``,
  3. ``--carbon.region`` looked up in the bundled tables,
  4. the stated world average, ``WORLD_DEFAULT_G_PER_KWH``.
"""

from __future__ import annotations

import csv
import difflib
import functools
import io
import math
import re
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.reference import DATA_DIR


class CarbonSettings(Protocol):
    """The flags ``resolve_intensity`` reads (the daemon's ``Config`` has them)."""

    @property
    def carbon_intensity(self) -> float | None: ...

    @property
    def carbon_region(self) -> str | None: ...

    @property
    def carbon_intensity_file(self) -> str | None: ...

#: World average carbon intensity of electricity generation used when nothing else is configured:
#: Ember, "Global Electricity Review 2024", world 2023 figure (480 gCO2/kWh, lifecycle, CO2-equivalent).
#: It is the same methodology (Ember via Our World in Data) as the country table.
WORLD_DEFAULT_G_PER_KWH = 480.0
WORLD_DEFAULT_YEAR = "2023"
WORLD_DEFAULT_REFERENCE = "Ember, Global Electricity Review 2024 (world average, 2023)"

COUNTRY_REFERENCE = "Our World in Data, based on Ember and the Energy Institute (CC BY 4.0)"

#: Values of the ``source`` label of gpuenergy_carbon_intensity_grams_per_kilowatt_hour.
SOURCE_FILE = "file"
SOURCE_FLAG = "flag"
SOURCE_TABLE = "table"
SOURCE_DEFAULT = "default"

#: ``region`` label when the world default is used.
WORLD_REGION = "world"

#: ``year`` label when a table row states no year (the cloud provider table).
UNKNOWN_YEAR = "unknown"

COUNTRY_FILE = "grid-carbon-intensity-by-country.csv"
CLOUD_FILE = "cloud-region-carbon-intensity.csv"

_WHERE_TO_LOOK = "see docs/configuration.md for the table of codes"


@dataclass(frozen=True)
class RegionIntensity:
    """One row of a bundled table."""

    code: str  # normalised lookup key: "FRA" or "gcp:europe-west1"
    name: str  # human name: "France", "Google Cloud Platform europe-west1 (St. Ghislain, Belgium)"
    grams_per_kwh: float  # gCO2e per kWh of electricity
    year: str  # year of the figure, or UNKNOWN_YEAR where the source does not state it
    reference: str  # who published the figure


class IntensityResolution(NamedTuple):
    """The intensity chosen at start-up and where it came from (the labels of the intensity gauge)."""

    value: float  # gCO2e/kWh
    source: str  # SOURCE_FILE, SOURCE_FLAG, SOURCE_TABLE or SOURCE_DEFAULT
    region: str  # normalised region code, WORLD_REGION for the default, "" when none was given
    year: str  # year of the figure; "" for a flag or file (the user's own number)


def _read_data(filename: str) -> str:
    # utf-8-sig: the cloud table was published with a byte-order mark; tolerate it if it comes back.
    return (DATA_DIR / filename).read_text(encoding="utf-8-sig")


def _parse_figure(raw: str, where: str) -> float:
    value = float(raw)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: carbon intensity {raw!r} is not a non-negative number")
    return value


@functools.cache
def country_table() -> dict[str, RegionIntensity]:
    """Country rows keyed by ISO 3166-1 alpha-3 code (upper case)."""
    table: dict[str, RegionIntensity] = {}
    for row in csv.DictReader(io.StringIO(_read_data(COUNTRY_FILE))):
        code = row["iso3"].strip().upper()
        table[code] = RegionIntensity(
            code=code,
            name=row["country"].strip(),
            grams_per_kwh=_parse_figure(row["grams_co2e_per_kwh"], f"{COUNTRY_FILE} {code}"),
            year=row["year"].strip() or UNKNOWN_YEAR,
            reference=COUNTRY_REFERENCE,
        )
    return table


@functools.cache
def cloud_table() -> dict[str, RegionIntensity]:
    """Cloud regions keyed by ``provider:region`` (lower case)."""
    table: dict[str, RegionIntensity] = {}
    for row in csv.DictReader(io.StringIO(_read_data(CLOUD_FILE))):
        provider, region = row["provider"].strip().lower(), row["region"].strip().lower()
        code = f"{provider}:{region}"
        place = ", ".join(p for p in (row["city"].strip(), row["country_name"].strip()) if p)
        table[code] = RegionIntensity(
            code=code,
            name=f"{row['providerName'].strip()} {region}" + (f" ({place})" if place else ""),
            grams_per_kwh=_parse_figure(row["impact"], f"{CLOUD_FILE} {code}"),
            year=UNKNOWN_YEAR,
            reference=row["source"].strip() or row["providerName"].strip(),
        )
    return table


def region_codes() -> list[str]:
    """Every accepted ``--carbon.region`` code, countries first (for docs and error messages)."""
    return sorted(country_table()) + sorted(cloud_table())


def normalise_region(code: str) -> str:
    """Countries are upper case (``fra`` -> ``FRA``), cloud regions lower case (``GCP:Europe-West1``)."""
    text = code.strip()
    if ":" in text:
        provider, _, region = text.partition(":")
        return f"{provider.strip().lower()}:{region.strip().lower()}"
    return text.upper()


def lookup_region(code: str) -> RegionIntensity:
    """The table row for ``code`` (ISO alpha-3 country or ``provider:region``), or a ConfigError that
    says what is accepted and where to find the codes."""
    key = normalise_region(code)
    if ":" in key:
        table = cloud_table()
        if key in table:
            return table[key]
        provider = key.partition(":")[0]
        providers = sorted({c.partition(":")[0] for c in table})
        if provider not in providers:
            raise ConfigError(
                f"unknown --carbon.region {code!r}: the bundled cloud table has regions of "
                f"{', '.join(providers)} only; use the region's country code (e.g. USA) or set "
                f"--carbon.intensity ({_WHERE_TO_LOOK})"
            )
        hint = _close(key, table)
        raise ConfigError(f"unknown --carbon.region {code!r}{hint} ({_WHERE_TO_LOOK})")
    countries = country_table()
    if key in countries:
        return countries[key]
    if re.fullmatch(r"[A-Z]{2}", key):
        raise ConfigError(
            f"unknown --carbon.region {code!r}: countries are ISO 3166-1 alpha-3 codes "
            f"(e.g. FRA for France, USA for the United States), not alpha-2 ({_WHERE_TO_LOOK})"
        )
    hint = _close(key, countries)
    raise ConfigError(
        f"unknown --carbon.region {code!r}: expected an ISO 3166-1 alpha-3 country code (e.g. FRA) or "
        f"provider:region (e.g. gcp:europe-west1){hint} ({_WHERE_TO_LOOK})"
    )


def _close(key: str, table: dict[str, RegionIntensity]) -> str:
    matches = difflib.get_close_matches(key, list(table), n=3, cutoff=0.75)
    return f"; did you mean {' or '.join(matches)}?" if matches else ""


def parse_intensity_text(text: str) -> float:
    """The content of an intensity file: one non-negative number of gCO2e/kWh (surrounding whitespace
    allowed). Raises ValueError with a reason otherwise."""
    stripped = text.strip()
    if not stripped:
        raise ValueError("the file is empty")
    try:
        value = float(stripped)
    except ValueError:
        raise ValueError(f"{stripped[:40]!r} is not a number (expected one number of gCO2e/kWh)") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{stripped[:40]!r} is not a non-negative finite number")
    return value


def read_intensity_file(path: str) -> float:
    """Read and parse an intensity file. Raises OSError or ValueError."""
    with open(path, encoding="utf-8") as f:
        # A sane intensity file is a few bytes; do not slurp a wrong, huge file.
        return parse_intensity_text(f.read(4096))


def resolve_intensity(config: CarbonSettings) -> IntensityResolution:
    """Choose the carbon intensity from the configuration (see the module docstring for the order).

    A ``--carbon.region`` is validated even when a flag or file overrides its figure, so a typo never
    passes silently; it then only labels the series. Raises ConfigError.
    """
    region = ""
    row: RegionIntensity | None = None
    if config.carbon_region:
        row = lookup_region(config.carbon_region)
        region = row.code
    if config.carbon_intensity_file:
        try:
            value = read_intensity_file(config.carbon_intensity_file)
        except OSError as exc:
            raise ConfigError(
                f"cannot read --carbon.intensity-file {config.carbon_intensity_file!r}: {exc.strerror or exc}"
            ) from None
        except ValueError as exc:
            raise ConfigError(
                f"--carbon.intensity-file {config.carbon_intensity_file!r} must hold one number of "
                f"gCO2e/kWh: {exc}"
            ) from None
        return IntensityResolution(value, SOURCE_FILE, region, "")
    if config.carbon_intensity is not None:
        return IntensityResolution(float(config.carbon_intensity), SOURCE_FLAG, region, "")
    if row is not None:
        return IntensityResolution(row.grams_per_kwh, SOURCE_TABLE, row.code, row.year)
    return IntensityResolution(WORLD_DEFAULT_G_PER_KWH, SOURCE_DEFAULT, WORLD_REGION, WORLD_DEFAULT_YEAR)


def reference_for(resolution: IntensityResolution, intensity_file: str | None = None) -> str:
    """Who published the figure in use (the ``reference`` label of gpuenergy_carbon_info)."""
    if resolution.source == SOURCE_FILE:
        return f"--carbon.intensity-file {intensity_file}" if intensity_file else "--carbon.intensity-file"
    if resolution.source == SOURCE_FLAG:
        return "--carbon.intensity"
    if resolution.source == SOURCE_TABLE:
        return lookup_region(resolution.region).reference
    return WORLD_DEFAULT_REFERENCE
