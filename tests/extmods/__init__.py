"""Small extension modules used by the tests (dotted paths: tests.extmods.*)."""
