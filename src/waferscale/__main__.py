from waferscale.cli import main

main()
