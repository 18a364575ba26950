from curvlab.cli import main

main()
