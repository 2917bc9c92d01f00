import pytest

import polestar


@pytest.fixture(scope="session")
def tiny_llada():
    return polestar.load("tiny-llada")


@pytest.fixture(scope="session")
def tiny_dream():
    return polestar.load("tiny-dream")
