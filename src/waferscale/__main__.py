from waferscale.cli import main

if __name__ == "__main__":  # a spawned child process (the body parser) imports this module too; it must not serve
    main()
