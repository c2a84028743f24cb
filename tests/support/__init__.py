"""Helpers shared by the test modules and the job scripts: no test lives here."""
