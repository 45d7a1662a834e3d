"""The public face of evflow: what users import."""

import evflow


def test_public_names_are_exported() -> None:
    for name in evflow.__all__:
        assert hasattr(evflow, name), name


def test_every_error_derives_from_evflow_error() -> None:
    from evflow import errors

    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(classes) > 5
    for cls in classes:
        assert issubclass(cls, errors.EvflowError), cls
