"""The hosted ``@program`` endpoints: ``/programs``."""
