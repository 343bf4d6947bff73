"""python -m symphony.kernel  ==  symphony-kernel"""
import sys

from symphony.kernel_cli import kernel_main

sys.exit(kernel_main())
