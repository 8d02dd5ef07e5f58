"""Entry point of the `gptkit` console script: registers the commands on the app."""
from gptkit_cli import (  # noqa: F401  (they register commands)
    checkpoint as _checkpoint,
    data as _data,
    estimate as _estimate,
    eval as _eval,
    generate as _generate,
    profile as _profile,
    quickstart as _quickstart,
    serve as _serve,
    tokenizer as _tokenizer,
    train as _train,
)
from gptkit_cli.app import app


def main():
    app()


if __name__ == '__main__':
    main()
