"""Package build: metadata, requirements and the console script come from settings.ini."""
from configparser import ConfigParser
from pathlib import Path

import setuptools

here = Path(__file__).parent
cfg = ConfigParser(delimiters=["="])
cfg.read(here / "settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

licenses = {"apache2": ("Apache Software License 2.0", "OSI Approved :: Apache Software License")}
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable"]
lic = licenses[cfg["license"]]

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    keywords=cfg["keywords"].split(),
    author=cfg["author"],
    author_email=cfg["author_email"],
    license=lic[0],
    classifiers=[
        f"Development Status :: {statuses[int(cfg['status']) - 1]}",
        f"Intended Audience :: {cfg['audience']}",
        f"License :: {lic[1]}",
        f"Natural Language :: {cfg['language']}",
        "Programming Language :: Python :: 3.11",
    ],
    python_requires=f">={cfg['min_python']}",
    packages=setuptools.find_packages(include=["gptkit", "gptkit.*"]) + ["gptkit_cli"],
    package_dir={"gptkit_cli": "cli"},
    include_package_data=True,
    package_data={'gptkit': ['assets/*.md', 'assets/*/*']},
    install_requires=cfg["requirements"].split(),
    extras_require={"dev": cfg["dev_requirements"].split(), "eval": cfg["eval_requirements"].split()},
    entry_points={
        "console_scripts": cfg["console_scripts"].split(),
        "nbdev": [f"{cfg['lib_name']}=gptkit._modidx:d"],
    },
    zip_safe=False,
)
