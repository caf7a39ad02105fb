from clgpt.cli import main

raise SystemExit(main())
