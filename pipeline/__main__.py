from pipeline.run import main

main()
